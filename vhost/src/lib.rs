//! vhost-user-blk backend.

#![deny(missing_docs)]
