//! `katablk-csi-ctl`: a small CSI client for operators and scripts (what kubelet and the
//! external provisioner would send), over the driver's unix socket.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use katablk_csi::csi::{
    self, controller_client::ControllerClient, identity_client::IdentityClient,
    node_client::NodeClient, volume_capability as vc,
};
use tonic::transport::Channel;

#[derive(Parser, Debug)]
#[command(
    name = "katablk-csi-ctl",
    version,
    about = "Talk CSI to katablk-csi over its unix socket"
)]
struct Args {
    /// The driver's endpoint.
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// GetPluginInfo and Probe.
    Probe,
    /// CreateVolume of a block volume (StorageClass parameter `spdk: "true"`, plus `-p k=v`),
    /// or with `--fs-type` a Filesystem one. Prints the volume id, its size and its context.
    Create {
        /// Volume name.
        name: String,
        /// Size in MiB.
        size_mib: i64,
        /// Extra StorageClass parameters, `key=value`.
        #[arg(short = 'p', long = "param")]
        params: Vec<String>,
        /// A Filesystem volume of this type instead of a Block one.
        #[arg(long)]
        fs_type: Option<String>,
    },
    /// NodePublishVolume of a block volume at TARGET (a file path inside the kubelet dir), or
    /// with `--fs-type` of a Filesystem volume at TARGET (a directory).
    Publish {
        /// Volume id returned by `create`.
        volume_id: String,
        /// Target path.
        target: PathBuf,
        /// Publish read-only.
        #[arg(long)]
        readonly: bool,
        /// A Filesystem volume of this type.
        #[arg(long)]
        fs_type: Option<String>,
        /// Volume context from `create`, `key=value` (e.g. `kataRuntime=rs`).
        #[arg(short = 'c', long = "context")]
        context: Vec<String>,
    },
    /// NodeUnpublishVolume.
    Unpublish {
        /// Volume id.
        volume_id: String,
        /// Target path.
        target: PathBuf,
    },
    /// DeleteVolume.
    Delete {
        /// Volume id.
        volume_id: String,
    },
    /// ControllerExpandVolume to SIZE_MIB, then NodeExpandVolume at TARGET when the controller
    /// asks for it (what csi-resizer and kubelet do for a block volume in use).
    Expand {
        /// Volume id.
        volume_id: String,
        /// New size in MiB.
        size_mib: i64,
        /// The published target path (for NodeExpandVolume).
        #[arg(long)]
        target: Option<PathBuf>,
    },
    /// ListVolumes.
    List,
}

async fn channel(endpoint: &str) -> Result<Channel> {
    let path = PathBuf::from(
        endpoint
            .strip_prefix("unix://")
            .context("endpoint must be unix:///path")?,
    );
    let ch = tonic::transport::Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }))
        .await
        .with_context(|| format!("cannot connect to {endpoint}"))?;
    Ok(ch)
}

fn block_cap() -> csi::VolumeCapability {
    capability(None)
}

/// Block, or a Filesystem volume of `fs_type`; single-node writer.
fn capability(fs_type: Option<&str>) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(match fs_type {
            None => vc::AccessType::Block(vc::BlockVolume {}),
            Some(fs) => vc::AccessType::Mount(vc::MountVolume {
                fs_type: fs.to_owned(),
                ..Default::default()
            }),
        }),
        access_mode: Some(vc::AccessMode {
            mode: vc::access_mode::Mode::SingleNodeWriter as i32,
        }),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let a = Args::parse();
    let ch = channel(&a.endpoint).await?;
    match a.cmd {
        Cmd::Probe => {
            let mut id = IdentityClient::new(ch);
            let info = id
                .get_plugin_info(csi::GetPluginInfoRequest {})
                .await?
                .into_inner();
            let probe = id.probe(csi::ProbeRequest {}).await?.into_inner();
            println!(
                "{} {} ready={:?}",
                info.name, info.vendor_version, probe.ready
            );
        }
        Cmd::Create {
            name,
            size_mib,
            params,
            fs_type,
        } => {
            let mut parameters: HashMap<String, String> =
                [("spdk".to_owned(), "true".to_owned())].into();
            for p in params {
                let (k, v) = p.split_once('=').context("parameters are key=value")?;
                parameters.insert(k.to_owned(), v.to_owned());
            }
            let r = ControllerClient::new(ch)
                .create_volume(csi::CreateVolumeRequest {
                    name,
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: size_mib << 20,
                        limit_bytes: 0,
                    }),
                    volume_capabilities: vec![capability(fs_type.as_deref())],
                    parameters,
                    ..Default::default()
                })
                .await?
                .into_inner();
            let v = r.volume.context("no volume in the reply")?;
            let mut ctx: Vec<String> = v
                .volume_context
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            ctx.sort();
            println!("{} {} {}", v.volume_id, v.capacity_bytes, ctx.join(","));
        }
        Cmd::Publish {
            volume_id,
            target,
            readonly,
            fs_type,
            context,
        } => {
            let mut volume_context = HashMap::new();
            for c in context.iter().flat_map(|c| c.split(',')) {
                let (k, v) = c.split_once('=').context("context entries are key=value")?;
                volume_context.insert(k.to_owned(), v.to_owned());
            }
            NodeClient::new(ch)
                .node_publish_volume(csi::NodePublishVolumeRequest {
                    volume_id,
                    target_path: target.display().to_string(),
                    volume_capability: Some(capability(fs_type.as_deref())),
                    readonly,
                    volume_context,
                    ..Default::default()
                })
                .await?;
            println!("published at {}", target.display());
        }
        Cmd::Unpublish { volume_id, target } => {
            NodeClient::new(ch)
                .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                    volume_id,
                    target_path: target.display().to_string(),
                })
                .await?;
            println!("unpublished {}", target.display());
        }
        Cmd::Delete { volume_id } => {
            ControllerClient::new(ch)
                .delete_volume(csi::DeleteVolumeRequest {
                    volume_id: volume_id.clone(),
                    ..Default::default()
                })
                .await?;
            println!("deleted {volume_id}");
        }
        Cmd::Expand {
            volume_id,
            size_mib,
            target,
        } => {
            let range = csi::CapacityRange {
                required_bytes: size_mib << 20,
                limit_bytes: 0,
            };
            let r = ControllerClient::new(ch.clone())
                .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                    volume_id: volume_id.clone(),
                    capacity_range: Some(range),
                    volume_capability: Some(block_cap()),
                    ..Default::default()
                })
                .await?
                .into_inner();
            let mut bytes = r.capacity_bytes;
            if r.node_expansion_required {
                if let Some(t) = target {
                    let n = NodeClient::new(ch)
                        .node_expand_volume(csi::NodeExpandVolumeRequest {
                            volume_id,
                            volume_path: t.display().to_string(),
                            capacity_range: Some(range),
                            volume_capability: Some(block_cap()),
                            ..Default::default()
                        })
                        .await?
                        .into_inner();
                    if n.capacity_bytes > 0 {
                        bytes = n.capacity_bytes;
                    }
                }
            }
            println!("{bytes}");
        }
        Cmd::List => {
            let r = ControllerClient::new(ch)
                .list_volumes(csi::ListVolumesRequest::default())
                .await?
                .into_inner();
            for e in r.entries {
                if let Some(v) = e.volume {
                    println!("{} {}", v.volume_id, v.capacity_bytes);
                }
            }
        }
    }
    Ok(())
}
