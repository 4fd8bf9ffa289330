//! The etcd API's [`Backend`] on top of the driver: calls become engine
//! requests on the driver's channel and wait for their answers.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use ferry_raft::{MembershipChange, NodeId};

use super::config::NodeConfig;
use super::driver::{Call, NodeView};
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

/// How often a membership change checks whether joint consensus is over.
const JOINT_POLL_INTERVAL: Duration = Duration::from_millis(10);

/// The backend of a Raft-replicated node.
pub struct RaftBackend {
    state: Arc<SharedState>,
    calls: mpsc::Sender<Call>,
    view: Arc<Mutex<NodeView>>,
    config: NodeConfig,
    clock_origin: Instant,
    member_add_lock: tokio::sync::Mutex<()>,
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
        calls: mpsc::Sender<Call>,
        view: Arc<Mutex<NodeView>>,
        config: NodeConfig,
        clock_origin: Instant,
    ) -> RaftBackend {
        RaftBackend {
            state,
            calls,
            view,
            config,
            clock_origin,
            member_add_lock: tokio::sync::Mutex::new(()),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Sends a call to the driver and waits for its answer, at most the
    /// request timeout (then the outcome is unknown: `Timeout`).
    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, ApiError>>) -> Call,
    ) -> Result<T, ApiError> {
        let (reply, answer) = oneshot::channel();
        self.calls
            .send(make(reply))
            .await
            .map_err(|_| ApiError::Stopped)?;
        match tokio::time::timeout(self.config.request_timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(ApiError::Stopped),
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

    fn state_config(&self) -> ferry_raft::Configuration {
        self.view
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .config
            .clone()
    }

    /// Runs a membership change and answers with the members once the
    /// change is complete: a change through joint consensus applies in two
    /// steps, and the engine proposes the second by itself, so wait (at most
    /// the request timeout) until this node's configuration is no longer
    /// joint. etcd answers with the members after the change.
    async fn change_membership(&self, change: MembershipChange) -> Result<Vec<Member>, ApiError> {
        self.call(|reply| Call::ChangeMembership { change, reply })
            .await?;
        let deadline = Instant::now() + self.config.request_timeout;
        while self.state_config().is_joint() {
            if Instant::now() >= deadline {
                return Err(ApiError::Timeout);
            }
            tokio::time::sleep(JOINT_POLL_INTERVAL).await;
        }
        Ok(self.members())
    }
}

impl Backend for RaftBackend {
    fn state(&self) -> &SharedState {
        &self.state
    }

    async fn propose(&self, command: Command) -> Result<CommandResponse, ApiError> {
        let command = encode_command(&command);
        self.call(|reply| Call::Propose { command, reply }).await
    }

    async fn read_index(&self) -> Result<(), ApiError> {
        self.call(|reply| Call::ReadIndex { reply }).await
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
        let peer_url = peer_urls
            .first()
            .ok_or(ApiError::InvalidArgument("MemberAdd needs a peer URL"))?;
        let peer_addr = peer_url
            .trim_start_matches("http://")
            .trim_start_matches("https://")
            .trim_end_matches('/')
            .to_string();
        let config = self.state_config();
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
        let record = crate::command::command(crate::command::CommandKind::MemberRecord(
            crate::pb::ferrypb::MemberRecordCommand {
                id,
                // Name and client URL are published by the member when it
                // starts; until then it lists as unstarted, as in etcd.
                name: String::new(),
                peer_addr,
                client_url: String::new(),
                create: true,
            },
        ));
        self.propose(record).await?;
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

    fn status(&self) -> NodeStatus {
        self.view
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .status
            .clone()
    }
}

/// A stream of one request, for forwarding a keep-alive.
fn futures_once<T: Send + 'static>(
    item: T,
) -> impl tonic::codegen::tokio_stream::Stream<Item = T> + Send + 'static {
    tonic::codegen::tokio_stream::iter(std::iter::once(item))
}
