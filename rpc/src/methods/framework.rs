//! Application/framework methods: version, method list, init, subsystems, config, kill.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{method, NoParams};

/// Result of `spdk_get_version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionInfo {
    /// Full version string, e.g. `"SPDK v26.09-pre"`.
    pub version: String,
    /// The version split into parts.
    pub fields: VersionFields,
}

/// `fields` of [`VersionInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionFields {
    /// Major (year) number.
    pub major: u32,
    /// Minor (month) number.
    pub minor: u32,
    /// Patch number.
    pub patch: u32,
    /// Suffix such as `"-pre"` (empty for releases).
    pub suffix: String,
    /// Git commit, when SPDK was built from a repository.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
}

method!(
    /// `spdk_get_version` → [`VersionInfo`].
    SpdkGetVersion = "spdk_get_version", NoParams => VersionInfo, idempotent: true
);

/// Params of `rpc_get_methods`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RpcGetMethodsParams {
    /// Only methods callable in the current state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<bool>,
    /// Include deprecated aliases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_aliases: Option<bool>,
}

method!(
    /// `rpc_get_methods` → list of method names.
    RpcGetMethods = "rpc_get_methods", RpcGetMethodsParams => Vec<String>, idempotent: true
);

method!(
    /// `framework_wait_init` → `true` once subsystems are initialized.
    FrameworkWaitInit = "framework_wait_init", NoParams => bool, idempotent: true
);

method!(
    /// `framework_start_init` → `true` (used by `load_config` when the app waits for RPC).
    FrameworkStartInit = "framework_start_init", NoParams => bool, idempotent: false
);

/// One entry of `framework_get_subsystems`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubsystemInfo {
    /// Subsystem name, e.g. `"bdev"`.
    pub subsystem: String,
    /// Names of the subsystems it depends on.
    pub depends_on: Vec<String>,
}

method!(
    /// `framework_get_subsystems` → subsystems in initialization order.
    FrameworkGetSubsystems = "framework_get_subsystems", NoParams => Vec<SubsystemInfo>, idempotent: true
);

/// Params of `framework_get_config`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrameworkGetConfigParams {
    /// Subsystem name.
    pub name: String,
    /// Keep batch arrays in the output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub with_batches: Option<bool>,
}

/// One RPC call in a saved configuration: `{"method": "...", "params": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigEntry {
    /// Method to call.
    pub method: String,
    /// Its params, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Value>,
}

method!(
    /// `framework_get_config` → the calls that recreate a subsystem's state (`null` for
    /// subsystems without config support).
    FrameworkGetConfig = "framework_get_config", FrameworkGetConfigParams => Option<Vec<ConfigEntry>>, idempotent: true
);

/// One subsystem of a saved configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubsystemConfig {
    /// Subsystem name.
    pub subsystem: String,
    /// Its calls; `null` when the subsystem has no config support.
    pub config: Option<Vec<ConfigEntry>>,
}

/// A whole configuration as written by SPDK's `save_config` and read by `load_config`:
/// `{"subsystems": [...]}`.
///
/// In SPDK these are client-side operations (`framework_get_subsystems` plus
/// `framework_get_config` per subsystem; and replaying the calls), and so they are in
/// [`crate::client::RpcClient::save_config`] / [`crate::client::RpcClient::load_config`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Subsystems in initialization order.
    pub subsystems: Vec<SubsystemConfig>,
}

/// Params of `spdk_kill_instance`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpdkKillInstanceParams {
    /// Signal name: `SIGINT`, `SIGTERM`, `SIGQUIT`, `SIGHUP`, `SIGKILL` or `SIGUSR1`.
    pub sig_name: String,
}

method!(
    /// `spdk_kill_instance` → `true` (the server may close the connection instead).
    SpdkKillInstance = "spdk_kill_instance", SpdkKillInstanceParams => bool, idempotent: false
);

/// Typed calls of the framework methods.
mod calls {
    use crate::client::RpcClient;
    use crate::error::RpcError;
    use crate::methods::*;

    impl RpcClient {
        /// `spdk_get_version`.
        pub async fn spdk_get_version(&self) -> Result<VersionInfo, RpcError> {
            self.call_method::<SpdkGetVersion>(&NoParams {}).await
        }

        /// `rpc_get_methods`.
        pub async fn rpc_get_methods(
            &self,
            params: &RpcGetMethodsParams,
        ) -> Result<Vec<String>, RpcError> {
            self.call_method::<RpcGetMethods>(params).await
        }

        /// `framework_wait_init`.
        pub async fn framework_wait_init(&self) -> Result<bool, RpcError> {
            self.call_method::<FrameworkWaitInit>(&NoParams {}).await
        }

        /// `framework_start_init`.
        pub async fn framework_start_init(&self) -> Result<bool, RpcError> {
            self.call_method::<FrameworkStartInit>(&NoParams {}).await
        }

        /// `framework_get_subsystems`.
        pub async fn framework_get_subsystems(&self) -> Result<Vec<SubsystemInfo>, RpcError> {
            self.call_method::<FrameworkGetSubsystems>(&NoParams {})
                .await
        }

        /// `framework_get_config` for one subsystem.
        pub async fn framework_get_config(
            &self,
            name: &str,
        ) -> Result<Option<Vec<ConfigEntry>>, RpcError> {
            self.call_method::<FrameworkGetConfig>(&FrameworkGetConfigParams {
                name: name.to_owned(),
                with_batches: None,
            })
            .await
        }

        /// `save_config`, assembled client-side as SPDK's `rpc.py save_config` does:
        /// `framework_get_subsystems`, then `framework_get_config` for each subsystem.
        pub async fn save_config(&self) -> Result<Config, RpcError> {
            let mut cfg = Config::default();
            for s in self.framework_get_subsystems().await? {
                let config = self.framework_get_config(&s.subsystem).await?;
                cfg.subsystems.push(SubsystemConfig {
                    subsystem: s.subsystem,
                    config,
                });
            }
            Ok(cfg)
        }

        /// `load_config`, as SPDK's `rpc.py load_config` does: check every method is known
        /// (`rpc_get_methods`), then replay the calls in order, in rounds, calling each one once
        /// it is allowed in the current state (`rpc_get_methods {"current": true}`) and
        /// `framework_start_init` when the server offers it. Returns the calls that could not be
        /// made.
        pub async fn load_config(&self, config: &Config) -> Result<Vec<ConfigEntry>, RpcError> {
            let mut todo: Vec<ConfigEntry> = config
                .subsystems
                .iter()
                .filter_map(|s| s.config.as_ref())
                .flatten()
                .cloned()
                .collect();
            let known = self
                .rpc_get_methods(&RpcGetMethodsParams::default())
                .await?;
            if let Some(e) = todo.iter().find(|e| !known.contains(&e.method)) {
                return Err(RpcError::Spdk {
                    code: crate::error::codes::METHOD_NOT_FOUND,
                    message: format!("Unknown method {:?} in the config", e.method),
                });
            }
            loop {
                let allowed = self
                    .rpc_get_methods(&RpcGetMethodsParams {
                        current: Some(true),
                        include_aliases: None,
                    })
                    .await?;
                let mut progressed = false;
                let mut rest = Vec::new();
                for e in todo {
                    if allowed.contains(&e.method) {
                        self.call_value(&e.method, e.params.clone(), false, self.timeout())
                            .await?;
                        progressed = true;
                    } else {
                        rest.push(e);
                    }
                }
                todo = rest;
                if allowed.iter().any(|m| m == FrameworkStartInit::NAME) {
                    self.framework_start_init().await?;
                    progressed = true;
                }
                if todo.is_empty() || !progressed {
                    return Ok(todo);
                }
            }
        }

        /// `spdk_kill_instance`. A connection closed by the dying server counts as success, as
        /// in SPDK's python client.
        pub async fn spdk_kill_instance(&self, sig_name: &str) -> Result<bool, RpcError> {
            match self
                .call_method::<SpdkKillInstance>(&SpdkKillInstanceParams {
                    sig_name: sig_name.to_owned(),
                })
                .await
            {
                Err(RpcError::Disconnected(_)) => Ok(true),
                r => r,
            }
        }
    }
}
