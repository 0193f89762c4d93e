//! The CSI Identity service: plugin info, capabilities and a Probe that asks the target.

use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};

use crate::csi::{self, plugin_capability};
use crate::driver::Driver;
use crate::error::CsiError;

/// Identity service.
#[derive(Debug, Clone)]
pub struct IdentityService {
    d: Arc<Driver>,
}

impl IdentityService {
    /// The service over a driver.
    pub fn new(d: Arc<Driver>) -> Self {
        Self { d }
    }
}

fn service_cap(t: plugin_capability::service::Type) -> csi::PluginCapability {
    csi::PluginCapability {
        r#type: Some(plugin_capability::Type::Service(
            plugin_capability::Service { r#type: t as i32 },
        )),
    }
}

#[tonic::async_trait]
impl csi::identity_server::Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _req: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        let t0 = Instant::now();
        let r = Ok(csi::GetPluginInfoResponse {
            name: self.d.cfg.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: [("transport".to_owned(), "vhost-user-blk".to_owned())].into(),
        });
        self.d.finish("GetPluginInfo", "", t0, r)
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use plugin_capability::service::Type;
        let t0 = Instant::now();
        let mut caps = vec![service_cap(Type::VolumeAccessibilityConstraints)];
        if self.d.cfg.mode.controller() {
            caps.insert(0, service_cap(Type::ControllerService));
        }
        caps.push(csi::PluginCapability {
            r#type: Some(plugin_capability::Type::VolumeExpansion(
                plugin_capability::VolumeExpansion {
                    r#type: plugin_capability::volume_expansion::Type::Online as i32,
                },
            )),
        });
        let r = Ok(csi::GetPluginCapabilitiesResponse { capabilities: caps });
        self.d.finish("GetPluginCapabilities", "", t0, r)
    }

    /// Ready when the target answers and the default lvstore (if any) is open; `UNAVAILABLE`
    /// when the target does not answer.
    async fn probe(
        &self,
        _req: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        let t0 = Instant::now();
        let r = async {
            let stores = self.d.lvstores().await.map_err(|e| {
                if e.is_unavailable() {
                    CsiError::Unavailable(e.to_string())
                } else {
                    e
                }
            })?;
            let ready = match &self.d.cfg.lvs {
                Some(l) => stores.iter().any(|s| &s.name == l),
                None => true,
            };
            Ok(csi::ProbeResponse { ready: Some(ready) })
        }
        .await;
        self.d.finish("Probe", "", t0, r)
    }
}
