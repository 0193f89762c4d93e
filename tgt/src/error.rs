//! Errors of the target, mapped onto the codes and messages SPDK clients see.

use katablk_lvol::LvolError;
use katablk_rpc::SpdkError;

/// Converts an lvol error to SPDK's reply.
pub fn lvol_err(e: LvolError) -> SpdkError {
    match e {
        LvolError::NoSpace { .. } | LvolError::MdFull(_) => {
            // SPDK answers -32602 with ENOSPC's message for an lvol that does not fit.
            SpdkError::invalid_params("No space left on device")
        }
        LvolError::Exists(_) => SpdkError::exists(),
        LvolError::NotFound(_) => SpdkError::no_such_device(),
        LvolError::NotPermitted(_) => SpdkError::internal("Operation not permitted"),
        LvolError::ReadOnly(_) => SpdkError::from_errno(libc::EPERM),
        LvolError::Busy(_) => SpdkError::busy(),
        LvolError::Invalid(m) => SpdkError::new(-libc::EINVAL, format!("Invalid argument: {m}")),
        other => SpdkError::internal(other.to_string()),
    }
}

/// A missing bdev in a vhost call: SPDK answers -32602 "No such device".
pub fn vhost_no_device() -> SpdkError {
    SpdkError::invalid_params("No such device")
}

/// A bdev that cannot be removed because something uses it.
pub fn in_use(what: &str, user: &str) -> SpdkError {
    SpdkError::new(
        -libc::EBUSY,
        format!("Device or resource busy: {what} is used by {user}"),
    )
}

/// An invalid argument, with an explanation.
pub fn einval(msg: impl std::fmt::Display) -> SpdkError {
    SpdkError::new(-libc::EINVAL, format!("Invalid argument: {msg}"))
}
