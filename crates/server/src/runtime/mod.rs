//! The node runtime: the thin process around the engine.
//!
//! One task (the driver) owns the Raft node, the storage and the state
//! machine's write side. Everything reaches it as an event on a channel:
//! client calls from the API, frames and link changes from the peer
//! transport, ticks from a timer, and sync completions from the thread that
//! runs fdatasync. It feeds each event to the engine and carries out the
//! actions that come back, in order. Work that grows with the state (a
//! snapshot's encoding, sync and decoding) runs on blocking threads, so
//! that heartbeats and client calls never wait for it:
//!
//! | action | what the driver does |
//! | --- | --- |
//! | `Persist` | append to the shared log; a sync is started at once if none is in flight, else the next one covers it (group commit); completions come back as `Persisted` |
//! | `Send` | encode and queue on the peer's connection (shed when full; the engine re-sends) |
//! | `Apply` | apply to the key-value state machine, answer the proposal waiting on that index and term, notify watchers |
//! | `Respond` | answer the waiting API call |
//! | `LoadSnapshotChunk` / `SaveSnapshotChunk` | read or write the snapshot store; the last chunk's file is synced and its state decoded on a blocking thread, then installed, and reported after the next log sync |
//! | `Compact` | compact the group's log |
//! | `RoleChanged` / `Removed` | log and publish in the node status |

mod backend;
mod config;
mod driver;

pub use backend::RaftBackend;
pub(crate) use config::member_addrs;
pub use config::{MemberAddrs, NodeConfig};
pub use driver::{start_node, RunningNode, StartError, KV_GROUP};
