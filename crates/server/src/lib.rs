//! ferry-server: the etcd v3 API on top of ferry.
//!
//! - [`mvcc`]: the multi-version store with etcd's revision model.
//! - [`kv_state`]: the replicated state machine (MVCC + leases), its
//!   deterministic `apply` and its checksummed snapshots.
//! - [`auth`]: users, roles and key permissions (replicated) and the
//!   permission checks; [`auth_token`]: the simple tokens (handed out
//!   through the log, held by every member) and JWTs that name an
//!   authenticated user.
//! - [`command`]: the commands that go through the Raft log, and their codec.
//! - [`watch`]: the watch hub.
//! - [`lease`]: lease deadlines on the leader's clock.
//! - [`member_id`]: member ids in hexadecimal (from the runtime).
//! - [`state`]: the state machine, watch hub, lease clock and simple tokens
//!   behind one lock.
//! - [`backend`]: the trait the API is written against, and the in-process
//!   single-node backend.
//! - [`api`]: the etcd gRPC services, and [`api::gateway`], the same calls
//!   as etcd's JSON/HTTP gateway on the same ports.
//! - [`backup`]: backups (etcd's Maintenance `Snapshot` stream, the file
//!   `etcdctl snapshot save` writes), inspected and restored into a new
//!   cluster.
//! - [`batched_writes`]: answers that are ready together leave a client
//!   connection in one write.
//! - [`authority`]: the repair of a URL sent as HTTP/2 `:authority` by etcd's
//!   Go client, below the HTTP/2 server that would refuse it.
//! - [`connections`]: idle client timeouts, with the runtime's limits per
//!   listener and per address and the split of the process's file
//!   descriptors between connections and storage.
//! - [`log_limit`]: rate limits for warnings a remote party can trigger
//!   (from the runtime).
//! - [`peer`]: the TCP transport between nodes and the wire form of engine
//!   messages (the runtime's [`ferry_runtime::transport`]).
//! - [`grpc_client`]: a gRPC client channel whose requests end on their
//!   last DATA frame, as Go's clients send them (`ferry bench` uses it).
//! - [`grpc_codec`]: the protobuf codec of the gRPC services, with buffers
//!   sized for etcd's messages.
//! - [`metrics`]: the metrics port: Prometheus metrics (etcd's names where
//!   the meaning is the same), gRPC call counts, `/health`, `/livez` and
//!   `/readyz`.
//! - [`node`]: the node: the key-value store run as one group on
//!   `ferry-runtime`, its housekeeping, and the [`backend::Backend`] it
//!   offers the API.

#![warn(missing_docs)]

pub mod api;
pub mod auth;
pub mod auth_token;
pub mod authority;
pub mod backend;
pub mod backup;
pub mod batched_writes;
pub mod command;
pub mod connections;
pub mod error;
pub mod grpc_client;
pub mod grpc_codec;
pub mod kv_state;
pub mod lease;
pub mod metrics;
pub mod mvcc;
/// The peer transport, from the runtime.
pub use ferry_runtime::transport as peer;
pub use ferry_runtime::{log_limit, member_id};
pub mod node;
pub(crate) mod snapshot_reader;
pub mod state;
pub mod tls;
pub mod watch;

pub mod pb {
    //! Messages and gRPC services generated from `proto/`.
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    /// etcd's `authpb` package: users, roles and permissions.
    pub mod authpb {
        tonic::include_proto!("authpb");
        include!(concat!(env!("OUT_DIR"), "/authpb.serde.rs"));
    }
    /// etcd's `mvccpb` package: key-values and watch events.
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
        include!(concat!(env!("OUT_DIR"), "/mvccpb.serde.rs"));
    }
    /// etcd's `etcdserverpb` package: the v3 API.
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
        include!(concat!(env!("OUT_DIR"), "/etcdserverpb.serde.rs"));
        /// The Watch service as the server runs it, answering with
        /// [`super::ferrypb::WatchResponseWire`] (see `build.rs`).
        pub mod watch_wire {
            include!(concat!(env!("OUT_DIR"), "/etcdserverpb.Watch.rs"));
        }
    }
    /// ferry's replicated commands and snapshots.
    pub mod ferrypb {
        tonic::include_proto!("ferrypb");
    }
}

#[cfg(test)]
mod tests;
