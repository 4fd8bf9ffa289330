//! What the API needs from a node, as a trait, and the in-process
//! single-node implementation used by tests and by `ferry` before the Raft
//! runtime is plugged in.
//!
//! The node runtime implements [`Backend`] on top of the Raft engine:
//! `propose` replicates a command and resolves once it is applied locally;
//! `read_index` is the linearizable-read barrier; the lease calls run on the
//! leader (followers forward them); membership and status come from the
//! engine.

use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::command::encode_command;
use crate::error::ApiError;
use crate::kv_state::{CommandResponse, KvLimits, Reads};
use crate::pb::etcdserverpb::Member;
use crate::pb::ferrypb::Command;
use crate::state::{SharedState, StateMachine};
use crate::watch::WatchLimits;

/// A node's view of itself and the cluster, for response headers and the
/// Maintenance Status call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeStatus {
    /// Id of the cluster.
    pub cluster_id: u64,
    /// Id of this member.
    pub member_id: u64,
    /// Member id of the leader this node knows, 0 if none.
    pub leader_id: u64,
    /// This node's current Raft term.
    pub raft_term: u64,
    /// Index of the last entry in this node's log.
    pub raft_index: u64,
    /// Index of the last entry this node applied.
    pub raft_applied_index: u64,
    /// Whether this member is a learner.
    pub is_learner: bool,
    /// Whether this member was removed from the cluster: it refuses client
    /// requests from then on (its state no longer follows the cluster).
    pub removed: bool,
    /// The fault this member detected in its own log or its peers' (a
    /// committed entry contradicted), if it halted its group: it refuses
    /// client requests from then on, as its state may not be the cluster's.
    pub halted: Option<String>,
    /// Problems worth telling an operator about.
    pub errors: Vec<String>,
}

/// What a defragment did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defragmented {
    /// The state is kept in memory: compaction freed what it removed.
    NothingToDo,
    /// The store on disk was merged into one run.
    Merged {
        /// Bytes of the store before the merge.
        size_bytes_before: u64,
        /// Bytes of the store after the merge.
        size_bytes_after: u64,
    },
}

/// The node operations the etcd API is built on.
///
/// All futures must be `Send`: they run on tonic's multi-threaded runtime.
pub trait Backend: Send + Sync + 'static {
    /// The local state machine: reads, watches and lease deadlines.
    fn state(&self) -> &SharedState;

    /// Replicates `command` and resolves with its result once it has been
    /// applied on this node, so a read after the answer sees the write.
    /// A refusal by the state machine comes back as `ApiError::Kv`.
    fn propose(
        &self,
        command: Command,
    ) -> impl Future<Output = Result<CommandResponse, ApiError>> + Send;

    /// Resolves once this node has applied every write committed before the
    /// call (Raft ReadIndex); linearizable reads wait on it.
    fn read_index(&self) -> impl Future<Output = Result<(), ApiError>> + Send;

    /// Renews a lease on the leader's clock: `Some(ttl)`, or `None` when the
    /// lease does not exist.
    fn lease_keep_alive(
        &self,
        id: i64,
    ) -> impl Future<Output = Result<Option<i64>, ApiError>> + Send;

    /// Seconds left on a lease by the leader's clock, `None` when unknown.
    fn lease_time_to_live(
        &self,
        id: i64,
    ) -> impl Future<Output = Result<Option<i64>, ApiError>> + Send;

    /// The cluster's members.
    fn member_list(&self) -> impl Future<Output = Result<Vec<Member>, ApiError>> + Send;

    /// Adds a member; returns it and the new member list.
    fn member_add(
        &self,
        peer_urls: Vec<String>,
        is_learner: bool,
    ) -> impl Future<Output = Result<(Member, Vec<Member>), ApiError>> + Send;

    /// Removes a member; returns the new member list.
    fn member_remove(&self, id: u64) -> impl Future<Output = Result<Vec<Member>, ApiError>> + Send;

    /// Gives back the space compaction freed (Defragment). Answers what
    /// was done, for the log. The default has nothing to do: a state kept
    /// in memory frees compacted versions when it compacts.
    fn defragment(&self) -> impl Future<Output = Defragmented> + Send {
        async { Defragmented::NothingToDo }
    }

    /// Changes the peer URLs of member `id` (MemberUpdate); returns the
    /// new member list. The default refuses: a backend without peers has
    /// no peer URLs to change.
    fn member_update(
        &self,
        id: u64,
        peer_urls: Vec<String>,
    ) -> impl Future<Output = Result<Vec<Member>, ApiError>> + Send {
        let _ = (id, peer_urls);
        async {
            Err(ApiError::Unimplemented(
                "MemberUpdate on a backend without peers",
            ))
        }
    }

    /// Promotes a learner to voter; returns the new member list.
    fn member_promote(&self, id: u64)
        -> impl Future<Output = Result<Vec<Member>, ApiError>> + Send;

    /// Hands leadership to voter `target` and waits until it leads
    /// (MoveLeader). Only the leader takes it. The default refuses: a
    /// backend without elections has no leadership to hand over.
    fn move_leader(&self, target: u64) -> impl Future<Output = Result<(), ApiError>> + Send {
        let _ = target;
        async {
            Err(ApiError::Unimplemented(
                "MoveLeader on a backend without elections",
            ))
        }
    }

    /// This node's status; also fills every response header.
    fn status(&self) -> NodeStatus;
}

/// A single-node backend that applies commands directly, without Raft:
/// everything it accepts is "committed" at once. For tests and demos.
#[derive(Debug)]
pub struct LocalBackend {
    state: SharedState,
    member: Member,
    cluster_id: u64,
    clock_origin: Instant,
}

/// Most leases one expiry command removes, so one command stays small.
pub const EXPIRED_LEASES_PER_COMMAND_MAX: usize = 64;

impl LocalBackend {
    /// A fresh single-member store advertising `client_url`.
    pub fn new(kv_limits: KvLimits, watch_limits: WatchLimits, client_url: String) -> LocalBackend {
        LocalBackend {
            state: SharedState::new(StateMachine::new(kv_limits, watch_limits)),
            member: Member {
                id: 1,
                name: "ferry-local".to_string(),
                peer_ur_ls: Vec::new(),
                client_ur_ls: vec![client_url],
                is_learner: false,
            },
            cluster_id: 0x_f3e7_7000_0000_0001,
            clock_origin: Instant::now(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Proposes the expiry of leases past their deadline, if any; returns
    /// how many leases were removed.
    pub async fn expire_leases(&self) -> Result<usize, ApiError> {
        let now_ms = self.now_ms();
        let command = self
            .state
            .lock()
            .expired_leases(now_ms, EXPIRED_LEASES_PER_COMMAND_MAX);
        match command {
            None => Ok(0),
            Some(command) => match self.propose(command).await? {
                CommandResponse::LeaseExpire { expired_ids, .. } => Ok(expired_ids.len()),
                other => Err(ApiError::Internal(format!(
                    "lease expiry answered with {other:?}"
                ))),
            },
        }
    }

    /// Runs lease expiry every `period` until the backend is dropped.
    pub fn spawn_lease_expiry(self: &Arc<Self>, period: Duration) -> tokio::task::JoinHandle<()> {
        let backend: Weak<LocalBackend> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(period);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let Some(backend) = backend.upgrade() else {
                    return;
                };
                if let Err(error) = backend.expire_leases().await {
                    tracing::warn!(%error, "lease expiry failed");
                }
            }
        })
    }
}

impl Backend for LocalBackend {
    fn state(&self) -> &SharedState {
        &self.state
    }

    async fn propose(&self, command: Command) -> Result<CommandResponse, ApiError> {
        // Through the codec, as a replicated entry would go.
        let bytes = bytes::Bytes::from(encode_command(&command));
        let now_ms = self.now_ms();
        let mut machine = self.state.lock();
        let index = machine.kv().applied_index() + 1;
        let applied = machine.apply_bytes_with(index, &bytes, Reads::Build);
        machine.sync_lease_clock(now_ms);
        Ok(applied.response?)
    }

    async fn read_index(&self) -> Result<(), ApiError> {
        Ok(())
    }

    async fn lease_keep_alive(&self, id: i64) -> Result<Option<i64>, ApiError> {
        let now_ms = self.now_ms();
        Ok(self.state.lock().lease_keep_alive(id, now_ms))
    }

    async fn lease_time_to_live(&self, id: i64) -> Result<Option<i64>, ApiError> {
        let now_ms = self.now_ms();
        Ok(self.state.lock().lease_remaining_seconds(id, now_ms))
    }

    async fn member_list(&self) -> Result<Vec<Member>, ApiError> {
        Ok(vec![self.member.clone()])
    }

    async fn member_add(
        &self,
        _peer_urls: Vec<String>,
        _is_learner: bool,
    ) -> Result<(Member, Vec<Member>), ApiError> {
        Err(ApiError::Unimplemented(
            "membership change on the in-process single-node backend",
        ))
    }

    async fn member_remove(&self, id: u64) -> Result<Vec<Member>, ApiError> {
        if id != self.member.id {
            return Err(ApiError::MemberNotFound);
        }
        Err(ApiError::NotEnoughMembers)
    }

    async fn member_promote(&self, id: u64) -> Result<Vec<Member>, ApiError> {
        if id != self.member.id {
            return Err(ApiError::MemberNotFound);
        }
        Err(ApiError::MemberNotLearner)
    }

    /// The one member leads already; no other can.
    async fn move_leader(&self, target: u64) -> Result<(), ApiError> {
        if target == self.member.id {
            Ok(())
        } else {
            Err(ApiError::BadLeaderTransferee)
        }
    }

    fn status(&self) -> NodeStatus {
        let applied = self.state.lock().kv().applied_index();
        NodeStatus {
            cluster_id: self.cluster_id,
            member_id: self.member.id,
            leader_id: self.member.id,
            raft_term: 1,
            raft_index: applied,
            raft_applied_index: applied,
            is_learner: false,
            removed: false,
            halted: None,
            errors: Vec::new(),
        }
    }
}
