//! Typed params and results of the SPDK methods katablk uses.
//!
//! Parameter names are exactly SPDK's (checked against SPDK's python client); params structs
//! reject unknown members (`deny_unknown_fields`), as SPDK does. Result structs serialize to
//! the shapes real SPDK v26.09 sends; the larger ones keep members they do not model in an
//! `extra` map so that nothing is lost in a decode/encode round trip.
//!
//! Each method is a marker type implementing [`Method`], which ties its name to its params and
//! result types; [`crate::client::RpcClient::call_method`] and
//! [`crate::server::Router::method`] use it.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub mod bdev;
pub mod framework;
pub mod katablk;
pub mod lvol;
pub mod vhost;

pub use bdev::*;
pub use framework::*;
pub use katablk::*;
pub use lvol::*;
pub use vhost::*;

/// One SPDK JSON-RPC method: its wire name, params and result types.
pub trait Method {
    /// The method name on the wire.
    const NAME: &'static str;
    /// True if calling it twice has the same effect as calling it once and it changes no
    /// state (a read). The client retries such calls once on a broken connection.
    const IDEMPOTENT: bool;
    /// Params type; [`NoParams`] for methods without params.
    type Params: Serialize + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static;
    /// Result type.
    type Result: Serialize + DeserializeOwned + std::fmt::Debug + Send + 'static;
}

/// Params of methods that take none. Serializes to `{}` (which the client omits from the
/// request) and rejects any member.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// Declare a marker type implementing [`Method`].
macro_rules! method {
    ($(#[$meta:meta])* $ty:ident = $name:literal, $params:ty => $result:ty, idempotent: $idem:expr) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default)]
        pub struct $ty;
        impl $crate::methods::Method for $ty {
            const NAME: &'static str = $name;
            const IDEMPOTENT: bool = $idem;
            type Params = $params;
            type Result = $result;
        }
    };
}
pub(crate) use method;

/// Names of every method typed in this module, in SPDK's naming.
pub const METHOD_NAMES: &[&str] = &[
    SpdkGetVersion::NAME,
    RpcGetMethods::NAME,
    FrameworkWaitInit::NAME,
    FrameworkStartInit::NAME,
    FrameworkGetSubsystems::NAME,
    FrameworkGetConfig::NAME,
    SpdkKillInstance::NAME,
    BdevGetBdevs::NAME,
    BdevGetIostat::NAME,
    BdevWaitForExamine::NAME,
    BdevSetQosLimit::NAME,
    BdevAioCreate::NAME,
    BdevAioDelete::NAME,
    BdevMallocCreate::NAME,
    BdevMallocDelete::NAME,
    BdevNullCreate::NAME,
    BdevNullDelete::NAME,
    BdevLvolCreateLvstore::NAME,
    BdevLvolGetLvstores::NAME,
    BdevLvolDeleteLvstore::NAME,
    BdevLvolRenameLvstore::NAME,
    BdevLvolGrowLvstore::NAME,
    BdevLvolCreate::NAME,
    BdevLvolGetLvols::NAME,
    BdevLvolDelete::NAME,
    BdevLvolResize::NAME,
    BdevLvolRename::NAME,
    BdevLvolSnapshot::NAME,
    BdevLvolClone::NAME,
    BdevLvolInflate::NAME,
    BdevLvolDecoupleParent::NAME,
    BdevLvolSetReadOnly::NAME,
    VhostCreateBlkController::NAME,
    VhostDeleteController::NAME,
    VhostGetControllers::NAME,
    VhostControllerSetCoalescing::NAME,
];

#[cfg(test)]
mod sample_tests;
