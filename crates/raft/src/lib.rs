//! # ferry-raft: the consensus engine
//!
//! A pure, deterministic Raft engine: it does no I/O, reads no clock and
//! spawns nothing. Time arrives as [`Input::Tick`]; randomness comes from a
//! seeded generator; everything the engine wants done comes back as an
//! [`Action`]. The same engine runs under the real runtime and under the
//! simulator, and a seed reproduces a run exactly.
//!
//! (The state and request matrix is documented below once the engine is
//! complete.)

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod io;
pub mod membership;
pub mod message;
pub mod node;
pub mod options;
pub mod request;
pub mod types;

pub use io::{Action, Input, PersistRequest};
pub use membership::{Configuration, MembershipChange};
pub use message::{AppendResult, Message, MessageBody, SnapshotOutcome};
pub use node::{InitError, RaftNode};
pub use options::Options;
pub use request::{
    ForwardedRequest, ReadConsistency, Request, RequestError, RequestId, Response, Role, Status,
};
pub use types::{Entry, EntryPayload, GroupId, HardState, Index, NodeId, RestoredState, SnapshotMeta, Term};
