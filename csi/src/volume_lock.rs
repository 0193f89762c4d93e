//! Per-volume serialisation: concurrent calls for the same volume (or snapshot, or name) run
//! one after another; calls for different volumes run in parallel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// A map of named async locks; entries are dropped when nobody holds or waits for them.
#[derive(Debug, Default)]
pub struct VolumeLocks {
    map: Arc<Mutex<HashMap<String, Arc<AsyncMutex<()>>>>>,
}

/// Holds the lock for one key until dropped.
#[derive(Debug)]
pub struct VolumeGuard {
    key: String,
    guard: Option<OwnedMutexGuard<()>>,
    map: Arc<Mutex<HashMap<String, Arc<AsyncMutex<()>>>>>,
}

impl VolumeLocks {
    /// An empty lock map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits for and takes the lock for `key`.
    pub async fn lock(&self, key: &str) -> VolumeGuard {
        let m = {
            let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(key.to_owned()).or_default().clone()
        };
        let guard = m.lock_owned().await;
        VolumeGuard {
            key: key.to_owned(),
            guard: Some(guard),
            map: self.map.clone(),
        }
    }

    /// Number of keys currently tracked (held or waited for).
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// True if no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for VolumeGuard {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = map.get(&self.key) {
            // Only the map holds it: nobody waits, so forget the key.
            if Arc::strong_count(m) == 1 {
                map.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn serialises_same_key_only() {
        let locks = Arc::new(VolumeLocks::new());
        let inside = Arc::new(AtomicUsize::new(0));
        let max = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (locks, inside, max) = (locks.clone(), inside.clone(), max.clone());
            tasks.push(tokio::spawn(async move {
                let _g = locks.lock("v1").await;
                let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                max.fetch_max(n, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
            }));
        }
        let _other = locks.lock("v2").await; // not blocked by v1
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(max.load(Ordering::SeqCst), 1);
        drop(_other);
        assert!(locks.is_empty());
    }
}
