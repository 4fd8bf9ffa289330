//! The etcd API's [`Backend`] on top of the runtime: calls become requests
//! on the key-value group's handle and wait for their answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_raft::{MembershipChange, NodeId, ReadConsistency, RequestError};
use ferry_runtime::{GroupError, GroupHandle, NodeHost};

use super::config::NodeConfig;
use super::machine::{KvMachine, StoreHome};
use crate::backend::{Backend, NodeStatus};
use crate::command::encode_command;
use crate::error::ApiError;
use crate::kv_state::CommandResponse;
use crate::pb::etcdserverpb::lease_client::LeaseClient;
use crate::pb::etcdserverpb::{LeaseKeepAliveRequest, LeaseTimeToLiveRequest, Member};
use crate::pb::ferrypb::Command;
use crate::state::SharedState;

/// How long a forwarded lease call may take.
const LEASE_FORWARD_TIMEOUT: Duration = Duration::from_secs(3);

/// How often a call that waits on the group (a membership change for the
/// end of joint consensus, MoveLeader for the new leader) looks again.
const VIEW_POLL_INTERVAL: Duration = Duration::from_millis(10);

/// The way back for a member whose log contradicts its group's.
const REPAIR_HINT: &str = "stop it, move its data directory aside, remove it with `etcdctl member remove`, \
     then add it back as a new member (`etcdctl member add --learner`) and start it empty with --join";

/// The backend of a Raft-replicated node.
pub struct RaftBackend {
    state: Arc<SharedState>,
    group: GroupHandle<KvMachine>,
    host: NodeHost,
    config: NodeConfig,
    clock_origin: Instant,
    member_add_lock: tokio::sync::Mutex<()>,
    /// Where the key-value state lives on disk (`None`: in memory).
    home: Option<Arc<StoreHome>>,
}

impl std::fmt::Debug for RaftBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftBackend")
            .field("node_id", &self.config.node_id)
            .finish()
    }
}

impl RaftBackend {
    pub(crate) fn new(
        state: Arc<SharedState>,
        group: GroupHandle<KvMachine>,
        host: NodeHost,
        config: NodeConfig,
        clock_origin: Instant,
        home: Option<Arc<StoreHome>>,
    ) -> RaftBackend {
        RaftBackend {
            state,
            group,
            host,
            config,
            clock_origin,
            member_add_lock: tokio::sync::Mutex::new(()),
            home,
        }
    }

    /// The key-value group's handle.
    pub(crate) fn group(&self) -> &GroupHandle<KvMachine> {
        &self.group
    }

    /// Whether the key-value state is kept on disk (`--kv-on-disk`).
    pub(crate) fn kv_on_disk(&self) -> bool {
        self.config.kv_on_disk
    }

    /// The runtime's host the node runs on.
    pub(crate) fn host(&self) -> &NodeHost {
        &self.host
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Waits for a call on the group, at most the request timeout (then
    /// the outcome is unknown: `Timeout`).
    async fn call<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, GroupError>>,
    ) -> Result<T, ApiError> {
        match tokio::time::timeout(self.config.request_timeout, call).await {
            Ok(result) => result.map_err(api_error),
            Err(_) => Err(ApiError::Timeout),
        }
    }

    fn leader(&self) -> Option<NodeId> {
        let leader = self.status().leader_id;
        (leader != 0).then_some(leader)
    }

    /// The leader's client URL, for calls that must run on its clock.
    fn leader_client_url(&self) -> Result<String, ApiError> {
        let leader = self.leader().ok_or(ApiError::NoLeader)?;
        self.addrs(leader)
            .map(|member| member.client_url)
            .filter(|url| !url.is_empty())
            .ok_or_else(|| {
                ApiError::Internal(format!("the leader {leader:x} has no known client URL"))
            })
    }

    /// Where member `id` can be reached, as far as this node knows.
    fn addrs(&self, id: NodeId) -> Option<super::config::MemberAddrs> {
        let machine = self.state.lock();
        super::config::member_addrs(&self.config.members, machine.kv().member_records(), id)
    }

    async fn leader_lease_client(
        &self,
    ) -> Result<LeaseClient<tonic::transport::Channel>, ApiError> {
        let url = self.leader_client_url()?;
        let endpoint = tonic::transport::Endpoint::from_shared(url.clone())
            .map_err(|error| ApiError::Internal(format!("bad leader URL {url}: {error}")))?
            .connect_timeout(LEASE_FORWARD_TIMEOUT)
            .timeout(LEASE_FORWARD_TIMEOUT);
        let channel = endpoint.connect().await.map_err(|_| ApiError::NoLeader)?;
        Ok(LeaseClient::new(channel))
    }

    fn is_leader(&self) -> bool {
        self.leader() == Some(self.config.node_id)
    }

    fn members(&self) -> Vec<Member> {
        let config = self.state_config();
        config
            .members()
            .into_iter()
            .map(|id| {
                let addrs = self.addrs(id);
                let addrs = addrs.as_ref();
                Member {
                    id,
                    name: addrs.map(|a| a.name.clone()).unwrap_or_default(),
                    peer_ur_ls: addrs
                        .map(|a| vec![format!("http://{}", a.peer_addr)])
                        .unwrap_or_default(),
                    // A member added but not yet started has published no
                    // client URL (etcd shows it the same way).
                    client_ur_ls: addrs
                        .filter(|a| !a.client_url.is_empty())
                        .map(|a| vec![a.client_url.clone()])
                        .unwrap_or_default(),
                    is_learner: config.is_learner(id),
                }
            })
            .collect()
    }

    /// etcd's strict reconfiguration check for a voter add: counting the
    /// new member as not started, the voters that are started (this node,
    /// and the peers it holds a working connection to) must form a quorum
    /// of the configuration after the add. Otherwise the add could leave
    /// the group without a quorum of live voters, and so without a leader,
    /// until the new member starts, which it may never do.
    fn check_quorum_after_add(&self, config: &ferry_raft::Configuration) -> Result<(), ApiError> {
        let connected = self.host.connected_peers();
        let me = self.config.node_id;
        let voters: std::collections::BTreeSet<NodeId> = config
            .voters
            .iter()
            .chain(&config.voters_outgoing)
            .copied()
            .collect();
        let check = strict_add_check(&voters, |id| id == me || connected.contains(&id));
        if let Err(error) = &check {
            tracing::info!(%error, "refusing a voter add");
        }
        check
    }

    fn state_config(&self) -> ferry_raft::Configuration {
        self.group.view_with(|view| view.config.clone())
    }

    /// Runs a membership change and answers with the members once the
    /// change is complete: a change through joint consensus applies in two
    /// steps, and the engine proposes the second by itself, so wait (at most
    /// the request timeout) until this node's configuration is no longer
    /// joint. etcd answers with the members after the change.
    async fn change_membership(&self, change: MembershipChange) -> Result<Vec<Member>, ApiError> {
        self.call(self.group.change_membership(change)).await?;
        let deadline = Instant::now() + self.config.request_timeout;
        while self.group.view_with(|view| view.config.is_joint()) {
            if Instant::now() >= deadline {
                return Err(ApiError::Timeout);
            }
            tokio::time::sleep(VIEW_POLL_INTERVAL).await;
        }
        Ok(self.members())
    }
}

impl Backend for RaftBackend {
    fn state(&self) -> &SharedState {
        &self.state
    }

    async fn propose(&self, command: Command) -> Result<CommandResponse, ApiError> {
        let encoded = encode_command(&command);
        // A put's key and value are slices of the buffer the request was
        // decoded from: let it go now, not when the entry is applied.
        drop(command);
        self.call(self.group.propose(encoded))
            .await?
            .map_err(ApiError::from)
    }

    async fn read_index(&self) -> Result<(), ApiError> {
        self.call(self.group.read_barrier(ReadConsistency::Linearizable))
            .await
            .map(|_| ())
    }

    async fn lease_keep_alive(&self, id: i64) -> Result<Option<i64>, ApiError> {
        if self.is_leader() {
            let now_ms = self.now_ms();
            return Ok(self.state.lock().lease_keep_alive(id, now_ms));
        }
        // Deadlines live on the leader's clock: renew there.
        let mut client = self.leader_lease_client().await?;
        let request = futures_once(LeaseKeepAliveRequest { id });
        let mut responses = client
            .lease_keep_alive(request)
            .await
            .map_err(|status| {
                ApiError::Internal(format!("forwarding the keep-alive to the leader: {status}"))
            })?
            .into_inner();
        match responses.message().await {
            Ok(Some(response)) if response.ttl > 0 => Ok(Some(response.ttl)),
            Ok(Some(_)) => Ok(None),
            Ok(None) => Err(ApiError::NoLeader),
            Err(status) => Err(ApiError::Internal(format!(
                "forwarding the keep-alive to the leader: {status}"
            ))),
        }
    }

    async fn lease_time_to_live(&self, id: i64) -> Result<Option<i64>, ApiError> {
        if self.is_leader() {
            let now_ms = self.now_ms();
            return Ok(self.state.lock().lease_remaining_seconds(id, now_ms));
        }
        let mut client = self.leader_lease_client().await?;
        match client
            .lease_time_to_live(LeaseTimeToLiveRequest { id, keys: false })
            .await
        {
            Ok(response) => {
                let ttl = response.into_inner().ttl;
                // The API reads the lease's granted TTL and keys from this
                // node's state: catch up with everything committed so far,
                // so a key just attached through another member shows.
                self.read_index().await?;
                Ok((ttl >= 0).then_some(ttl))
            }
            Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
            Err(status) => Err(ApiError::Internal(format!(
                "asking the leader for the lease's TTL: {status}"
            ))),
        }
    }

    async fn member_list(&self) -> Result<Vec<Member>, ApiError> {
        self.read_index().await?;
        Ok(self.members())
    }

    async fn member_add(
        &self,
        peer_urls: Vec<String>,
        is_learner: bool,
    ) -> Result<(Member, Vec<Member>), ApiError> {
        // One add at a time through this node, so two adds here cannot pick
        // the same id. Adds through different nodes at the same moment may
        // pick the same id: the state machine refuses the second record
        // (`create`), so its add fails before any membership change and the
        // client retries with a fresh id.
        let _adding = self.member_add_lock.lock().await;
        // Every URL must be one a member could be dialed at, as etcd
        // checks: an unreachable voter would count toward the quorum and
        // could leave the group unable to elect a leader.
        let peer_addr = first_peer_addr(&peer_urls, "member add")?;
        let Some(peer_url) = peer_urls.first() else {
            return Err(ApiError::BadMemberUrls);
        };
        let config = self.state_config();
        if !is_learner {
            self.check_quorum_after_add(&config)?;
        }
        let known: Vec<NodeId> = {
            let machine = self.state.lock();
            machine.kv().member_records().keys().copied().collect()
        };
        for id in config.members() {
            if self.addrs(id).is_some_and(|a| a.peer_addr == peer_addr) {
                return Err(ApiError::PeerUrlExists);
            }
        }
        // Ids are small integers, as `ferry serve --id` takes them: one more
        // than any id this cluster has ever seen.
        let id = config
            .members()
            .into_iter()
            .chain(known)
            .chain(self.config.members.keys().copied())
            .max()
            .unwrap_or(0)
            + 1;
        // The addresses first, so that every node can dial the new member
        // as soon as the configuration names it.
        // Name and client URL are published by the member when it starts;
        // until then it lists as unstarted, as in etcd.
        self.propose(crate::command::peer_record(id, peer_addr, true))
            .await?;
        let change = if is_learner {
            MembershipChange::AddLearner(id)
        } else {
            MembershipChange::AddVoter(id)
        };
        let members = self.change_membership(change).await?;
        let member = members
            .iter()
            .find(|m| m.id == id)
            .cloned()
            .unwrap_or(Member {
                id,
                name: String::new(),
                peer_ur_ls: vec![peer_url.clone()],
                client_ur_ls: Vec::new(),
                is_learner,
            });
        Ok((member, members))
    }

    async fn member_remove(&self, id: u64) -> Result<Vec<Member>, ApiError> {
        if !self.state_config().contains(id) {
            return Err(ApiError::MemberNotFound);
        }
        self.change_membership(MembershipChange::Remove(id)).await
    }

    async fn defragment(&self) -> crate::backend::Defragmented {
        let Some(home) = &self.home else {
            return crate::backend::Defragmented::NothingToDo;
        };
        let size_bytes_before = self.state.lock().kv().store().size_bytes();
        home.defragment(self.state.clone()).await;
        crate::backend::Defragmented::Merged {
            size_bytes_before,
            size_bytes_after: self.state.lock().kv().store().size_bytes(),
        }
    }

    async fn member_update(
        &self,
        id: u64,
        peer_urls: Vec<String>,
    ) -> Result<Vec<Member>, ApiError> {
        let config = self.state_config();
        if !config.contains(id) {
            return Err(ApiError::MemberNotFound);
        }
        // Checked as MemberAdd checks them.
        let peer_addr = first_peer_addr(&peer_urls, "member update")?;
        for other in config.members() {
            if other != id && self.addrs(other).is_some_and(|a| a.peer_addr == peer_addr) {
                return Err(ApiError::PeerUrlExists);
            }
        }
        // Replicated as the member's record: every member dials it at the
        // new address once it has applied it.
        self.propose(crate::command::peer_record(id, peer_addr, false))
            .await?;
        Ok(self.members())
    }

    async fn member_promote(&self, id: u64) -> Result<Vec<Member>, ApiError> {
        let config = self.state_config();
        if !config.contains(id) {
            return Err(ApiError::MemberNotFound);
        }
        if !config.is_learner(id) {
            return Err(ApiError::MemberNotLearner);
        }
        self.change_membership(MembershipChange::PromoteLearner(id))
            .await
    }

    /// etcd's MoveLeader: on the leader only, to a voter; waits (at most
    /// the request timeout) until the target leads.
    async fn move_leader(&self, target: u64) -> Result<(), ApiError> {
        let me = self.config.node_id;
        if self.leader() != Some(me) {
            return Err(ApiError::NotLeader);
        }
        if !self.state_config().is_voter(target) {
            return Err(ApiError::BadLeaderTransferee);
        }
        if target == me {
            return Ok(());
        }
        let deadline = Instant::now() + self.config.request_timeout;
        self.call(self.group.transfer_leadership(target)).await?;
        while self.leader() != Some(target) {
            if Instant::now() >= deadline {
                return Err(ApiError::TimeoutLeaderTransfer);
            }
            tokio::time::sleep(VIEW_POLL_INTERVAL).await;
        }
        Ok(())
    }

    fn status(&self) -> NodeStatus {
        let me = self.config.node_id;
        let mut status = self.group.view_with(|view| NodeStatus {
            cluster_id: self.config.cluster_id,
            member_id: me,
            leader_id: view.leader.unwrap_or(0),
            raft_term: view.term,
            raft_index: view.last_index,
            raft_applied_index: view.applied,
            is_learner: view.config.is_learner(me),
            removed: view.removed,
            halted: view.halted.clone(),
            errors: Vec::new(),
        });
        if status.removed {
            status
                .errors
                .push("this member has been removed from the cluster".into());
        }
        if let Some(fault) = &status.halted {
            status.errors.push(format!(
                "this member halted on a detected fault: {fault}; {REPAIR_HINT}"
            ));
        }
        status.errors.extend(self.host.troubles());
        status
    }
}

/// The API's error for a failed call on the group.
fn api_error(error: GroupError) -> ApiError {
    match error {
        GroupError::Engine(error) => match error {
            RequestError::NotLeader { .. } | RequestError::NoLeader => ApiError::NoLeader,
            RequestError::LeadershipLost => ApiError::NoLeader,
            RequestError::Timeout => ApiError::Timeout,
            RequestError::LearnerNotCaughtUp { .. } => ApiError::LearnerNotReady,
            RequestError::Removed => ApiError::Removed,
            RequestError::Halted { reason } => ApiError::Halted(reason),
            RequestError::Busy { .. }
            | RequestError::MembershipChangePending
            | RequestError::InvalidMembershipChange { .. }
            | RequestError::TransferInProgress
            | RequestError::CannotCampaign { .. }
            | RequestError::LeaseReadsDisabled => ApiError::Internal(error.to_string()),
        },
        // A new leader replaced the entry: it was not applied (etcd answers
        // a proposal lost to a leader change the same way).
        GroupError::Dropped => ApiError::NoLeader,
        GroupError::NotRunning { .. } => ApiError::Stopped,
        // Applied from a streamed state: the outcome is unknown to the
        // caller.
        GroupError::AppliedWithoutAnswer => ApiError::Timeout,
        // This member's store failed: the group is stopped here (the
        // command is committed and applies on the others).
        GroupError::MachineFailed { .. } => ApiError::Halted(error.to_string()),
        GroupError::AlreadyRunning { .. }
        | GroupError::Start { .. }
        | GroupError::Storage { .. }
        | GroupError::WrongMachine { .. } => ApiError::Internal(error.to_string()),
    }
}

/// The strict reconfiguration check (see
/// `RaftBackend::check_quorum_after_add`) over the current `voters`, with
/// `started` telling which of them are started and reachable.
fn strict_add_check(
    voters: &std::collections::BTreeSet<NodeId>,
    started: impl Fn(NodeId) -> bool,
) -> Result<(), ApiError> {
    let started = voters.iter().filter(|id| started(**id)).count();
    let voters_after = voters.len() + 1;
    let quorum = voters_after / 2 + 1;
    if started < quorum {
        return Err(ApiError::NotEnoughStartedMembers {
            voters: voters_after,
            started,
            quorum,
        });
    }
    Ok(())
}

/// The address to dial for a peer URL, or why the URL is not one: as etcd
/// takes them, `http://` or `https://`, then `host:port` (a bracketed IPv6
/// address as host), and nothing after (no path, query or user).
/// The address a member is dialed at, from the peer URLs a MemberAdd or
/// MemberUpdate names (`call`, for the log): the first one, once every one
/// has been checked to be a URL a member could be dialed at.
fn first_peer_addr(peer_urls: &[String], call: &str) -> Result<String, ApiError> {
    let mut first = None;
    for url in peer_urls {
        match peer_url_addr(url) {
            Ok(addr) => {
                first.get_or_insert(addr);
            }
            Err(reason) => {
                tracing::info!(url = %url, %reason, "refusing a {call}");
                return Err(ApiError::BadMemberUrls);
            }
        }
    }
    first.ok_or(ApiError::BadMemberUrls)
}

pub(crate) fn peer_url_addr(url: &str) -> Result<String, String> {
    let url = url.trim();
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| format!("{url:?} is not a URL (no scheme)"))?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return Err(format!("URL scheme must be http or https: {url:?}"));
    }
    if rest.contains(['/', '?', '#']) {
        return Err(format!("URL must not contain a path: {url:?}"));
    }
    if rest.contains('@') {
        return Err(format!("URL must not contain a user: {url:?}"));
    }
    let not_host_port = || format!("URL address does not have the form \"host:port\": {url:?}");
    let (host, port) = if let Some(bracketed) = rest.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or_else(not_host_port)?;
        let port = after.strip_prefix(':').ok_or_else(not_host_port)?;
        let ipv6 = !host.is_empty()
            && host.contains(':')
            && host
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.');
        if !ipv6 {
            return Err(format!("{host:?} is not an IPv6 address: {url:?}"));
        }
        (host, port)
    } else {
        let (host, port) = rest.rsplit_once(':').ok_or_else(not_host_port)?;
        let name = !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_');
        if !name {
            return Err(not_host_port());
        }
        (host, port)
    };
    let port_ok = !port.is_empty()
        && port.chars().all(|c| c.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|p| p > 0);
    if !port_ok {
        return Err(format!("URL has no valid port: {url:?}"));
    }
    Ok(if rest.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

/// A stream of one request, for forwarding a keep-alive.
fn futures_once<T: Send + 'static>(
    item: T,
) -> impl tonic::codegen::tokio_stream::Stream<Item = T> + Send + 'static {
    tonic::codegen::tokio_stream::iter(std::iter::once(item))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_urls_are_checked_as_etcd_checks_them() {
        for (url, addr) in [
            ("http://127.0.0.1:2380", "127.0.0.1:2380"),
            (" https://node-2.example:12380 ", "node-2.example:12380"),
            ("HTTP://[::1]:2380", "[::1]:2380"),
        ] {
            assert_eq!(peer_url_addr(url).as_deref(), Ok(addr), "{url}");
        }
        for url in [
            "",
            "not a url",
            "http://[::1",
            "http://[::1]",
            "http://[nothost]:1",
            "127.0.0.1:2380",
            "unix://x:1",
            "http://host",
            "http://host:",
            "http://host:0",
            "http://host:65536",
            "http://host:12ab",
            "http://:2380",
            "http://a b:1",
            "http://h:1/",
            "http://h:1/path",
            "http://h:1?q",
            "http://u@h:1",
            "http://a:b:1",
        ] {
            assert!(peer_url_addr(url).is_err(), "{url:?} should be refused");
        }
    }

    #[test]
    fn a_voter_add_needs_a_quorum_of_started_voters_after_it() {
        let voters = |ids: &[NodeId]| ids.iter().copied().collect();
        let all_up = |_: NodeId| true;
        // 3 voters up: the 4th (quorum 3) and the 5th (quorum 3) may come.
        assert!(strict_add_check(&voters(&[1, 2, 3]), all_up).is_ok());
        let three_of_four = |id: NodeId| id <= 3;
        assert!(strict_add_check(&voters(&[1, 2, 3, 4]), three_of_four).is_ok());
        // The 6th would need 4 of 6 with 3 up: refused with the counts.
        let three_of_five = |id: NodeId| id <= 3;
        assert_eq!(
            strict_add_check(&voters(&[1, 2, 3, 4, 5]), three_of_five),
            Err(ApiError::NotEnoughStartedMembers {
                voters: 6,
                started: 3,
                quorum: 4
            })
        );
        // A one-voter cluster cannot take a second voter before it starts.
        assert!(strict_add_check(&voters(&[1]), all_up).is_err());
        // Two of three up: a 4th voter (quorum 3) is refused.
        assert!(strict_add_check(&voters(&[1, 2, 3]), |id| id != 3).is_err());
    }
}
