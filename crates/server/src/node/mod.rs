//! The node: the key-value store run as one group on ferry-runtime.
//!
//! The runtime's host owns the engine, the shared log, the snapshots and the
//! links to the other members, and runs the key-value group on a worker:
//! its state machine applies committed commands to the shared state (and
//! feeds its watchers under the same lock), writes snapshots of it from a
//! consistent view on a blocking thread, and restores received ones there
//! too. Around the group, the node runs:
//!
//! - the etcd API ([`crate::api`]) on the [`RaftBackend`], which proposes
//!   through the group's handle, waits on read barriers for linearizable
//!   reads, and reads the status from the group's view;
//! - its housekeeping task: lease expiry proposed by the leader on its
//!   clock, this member publishing its own addresses, and dialing exactly
//!   the members of the configuration (a removed one a little longer, so
//!   that it learns of its removal).

mod backend;
mod config;
mod disk_space;
mod machine;
mod start;

pub use backend::RaftBackend;
pub(crate) use config::member_addrs;
pub use config::{
    ClientListen, MemberAddrs, NodeConfig, IN_MEMORY_SNAPSHOT_ENTRIES, ON_DISK_CHECKPOINT_ENTRIES,
};
pub(crate) use machine::first_store_dir;
pub use machine::{KV_DIR, KV_FLUSH_BYTES};
pub use start::{start_node, RunningNode, StartError, KV_GROUP};
