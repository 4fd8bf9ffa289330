//! The clients of a nemesis run, each a task in the hub namespace talking
//! gRPC to the members:
//!
//! - **Register clients** read, put and compare-and-set (a Txn) a few keys
//!   `r/<n>` through one member at a time, moving to another after an
//!   error and now and then at random. Every written value is unique in
//!   the run, so a value read names the write it came from.
//! - **Watchers** keep a watch on every key of the test from revision 1,
//!   ask for progress notifications, and when a stream breaks (or at
//!   random, on purpose) resume on another member from one past the last
//!   revision they know complete.
//! - **Lease clients** grant a lease, attach a fresh key `l/<n>` to it,
//!   keep it alive a while, then revoke it or let it expire (polling
//!   TimeToLive until the lease is gone), and read the key afterwards.
//!
//! Every operation is recorded with its times and answer (see `history`).
//! A request gets [`OP_TIMEOUT`] to answer; after that its outcome is
//! unknown.

use std::sync::Arc;
use std::time::Duration;

use ferry_server::pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use ferry_server::pb::etcdserverpb::kv_client::KvClient;
use ferry_server::pb::etcdserverpb::lease_client::LeaseClient;
use ferry_server::pb::etcdserverpb::maintenance_client::MaintenanceClient;
use ferry_server::pb::etcdserverpb::watch_client::WatchClient;
use ferry_server::pb::etcdserverpb::{
    alarm_request::AlarmAction, request_op, watch_request, AlarmRequest, AlarmType, Compare,
    HashKvRequest, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseRevokeRequest,
    LeaseTimeToLiveRequest, PutRequest, RangeRequest, RequestOp, StatusRequest, TxnRequest,
    WatchCreateRequest, WatchProgressRequest, WatchRequest,
};
use ferry_server::pb::mvccpb::event::EventType;
use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

use super::history::{
    Op, OpRecord, Outcome, Record, Recorder, WatchEvent, WatchRecord, WatchStep, LEASE_PREFIX,
    REGISTER_PREFIX,
};
use super::testbed::{member_address, CLIENT_PORT};

/// How long a request may take before its outcome counts as unknown.
pub const OP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a client waits after an error before its next request.
const BACKOFF: Duration = Duration::from_millis(50);
/// How long a watch stream may be silent while progress is asked of it
/// before the watcher gives up on it and resumes elsewhere.
const WATCH_SILENCE_MAX: Duration = Duration::from_secs(3);
/// How often a watcher asks for progress.
const PROGRESS_EVERY: Duration = Duration::from_millis(400);
/// The lease TTL the lease clients ask for, in seconds.
const LEASE_TTL_SECS: i64 = 2;
/// The first key of the watched range (every lease key and register key
/// of the test lies in `[WATCH_FROM, WATCH_END)`).
const WATCH_FROM: &str = "l/";
/// One past the last key watched: `r0` sorts right after every `r/...`.
const WATCH_END: &str = "r0";

/// What every client shares: the members' channels, the recorder and the
/// phase of the run.
#[derive(Clone)]
pub struct Clients {
    /// One channel per member, member `id` at index `id - 1`.
    pub channels: Arc<Vec<Channel>>,
    /// Where operations go.
    pub recorder: Recorder,
    /// Turns true when the clients are to stop starting operations.
    pub stop: watch::Receiver<bool>,
}

/// Opens a lazy channel to every member's client port (the connection is
/// made, and made again after a member restarts, when a request needs it).
pub fn channels(members: u64) -> Result<Vec<Channel>, String> {
    (1..=members)
        .map(|id| {
            let url = format!("http://{}:{CLIENT_PORT}", member_address(id));
            Endpoint::from_shared(url.clone())
                .map(|endpoint| {
                    endpoint
                        .connect_timeout(Duration::from_secs(1))
                        .tcp_nodelay(true)
                        .connect_lazy()
                })
                .map_err(|error| format!("{url}: {error}"))
        })
        .collect()
}

impl Clients {
    fn members(&self) -> u64 {
        self.channels.len() as u64
    }

    fn channel(&self, member: u64) -> Channel {
        self.channels[(member - 1) as usize].clone()
    }

    fn stopped(&self) -> bool {
        *self.stop.borrow()
    }
}

/// A request's result: its answer, or the error; `Err(None)` when it timed
/// out.
type Answer<T> = Result<T, Option<tonic::Status>>;

async fn timed<T, F>(future: F) -> Answer<T>
where
    F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    match tokio::time::timeout(OP_TIMEOUT, future).await {
        Err(_) => Err(None),
        Ok(Err(status)) => Err(Some(status)),
        Ok(Ok(response)) => Ok(response.into_inner()),
    }
}

/// How a failed write ended: certainly without effect for the answers
/// ferry (and etcd) give only for requests they did not carry out,
/// unknown for everything else (a timeout, a lost connection, `request
/// timed out`, `leader changed`, ...).
fn failed_write(error: &Option<tonic::Status>) -> Outcome {
    match error.as_ref().map(tonic::Status::code) {
        // NOSPACE, a request too large, a lease that does not exist: the
        // request was refused before or instead of taking effect.
        Some(Code::ResourceExhausted | Code::InvalidArgument | Code::NotFound) => Outcome::Fail,
        _ => Outcome::Unknown,
    }
}

fn error_text(error: &Option<tonic::Status>) -> String {
    match error {
        None => format!("no answer within {} ms", OP_TIMEOUT.as_millis()),
        Some(status) => format!("{:?}: {}", status.code(), status.message()),
    }
}

/// How a write went, as its client acts on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Written {
    /// It took effect.
    Ok,
    /// A compare-and-set whose compare failed.
    CompareFailed,
    /// Refused (NOSPACE, a lease not found, ...): certainly no effect.
    Refused,
    /// Unknown.
    Unknown,
}

impl Written {
    fn of(outcome: Outcome) -> Written {
        match outcome {
            Outcome::Ok => Written::Ok,
            Outcome::Fail => Written::Refused,
            Outcome::Unknown => Written::Unknown,
        }
    }
}

/// A record of an operation with nothing answered yet.
fn record(process: u64, member: u64, invoked_us: u64, op: Op) -> OpRecord {
    OpRecord {
        process,
        member,
        invoked_us,
        completed_us: None,
        op,
        outcome: Outcome::Unknown,
        revision: None,
        found: None,
        value: None,
        value_lease: None,
        lease: None,
        ttl_secs: None,
        error: None,
    }
}

/// The key of register `n`.
pub fn register_key(n: u64) -> String {
    format!("{REGISTER_PREFIX}{n}")
}

/// Reads `key` through `member` and records it as `process`'s operation;
/// returns the value found, if the read succeeded.
pub async fn get(
    clients: &Clients,
    process: u64,
    member: u64,
    key: &str,
    serializable: bool,
) -> Result<Option<String>, ()> {
    let mut kv = KvClient::new(clients.channel(member));
    let mut rec = record(
        process,
        member,
        clients.recorder.now_us(),
        Op::Get {
            key: key.to_string(),
            serializable,
        },
    );
    let answer = timed(kv.range(RangeRequest {
        key: key.as_bytes().to_vec(),
        serializable,
        ..Default::default()
    }))
    .await;
    rec.completed_us = Some(clients.recorder.now_us());
    let result = match answer {
        Ok(response) => {
            rec.outcome = Outcome::Ok;
            rec.revision = response.header.map(|h| h.revision);
            let found = response.kvs.first();
            rec.found = Some(found.is_some());
            rec.value = found.map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
            rec.value_lease = found.map(|kv| kv.lease);
            Ok(rec.value.clone())
        }
        Err(error) => {
            // A read that failed had no effect, whatever the error.
            rec.outcome = Outcome::Fail;
            rec.error = Some(error_text(&error));
            Err(())
        }
    };
    clients.recorder.push(Record::Op(rec));
    result
}

async fn put(
    clients: &Clients,
    process: u64,
    member: u64,
    key: &str,
    value: &str,
    lease: Option<i64>,
) -> Written {
    let mut kv = KvClient::new(clients.channel(member));
    let mut rec = record(
        process,
        member,
        clients.recorder.now_us(),
        Op::Put {
            key: key.to_string(),
            value: value.to_string(),
            lease,
        },
    );
    let answer = timed(kv.put(PutRequest {
        key: bytes::Bytes::copy_from_slice(key.as_bytes()),
        value: bytes::Bytes::copy_from_slice(value.as_bytes()),
        lease: lease.unwrap_or(0),
        ..Default::default()
    }))
    .await;
    finish_write(
        clients,
        &mut rec,
        answer.map(|r| r.header.map(|h| h.revision)),
    );
    let written = Written::of(rec.outcome);
    clients.recorder.push(Record::Op(rec));
    written
}

/// Completes a write's record from its answer (the header's revision).
fn finish_write(clients: &Clients, rec: &mut OpRecord, answer: Answer<Option<i64>>) {
    match answer {
        Ok(revision) => {
            rec.completed_us = Some(clients.recorder.now_us());
            rec.outcome = Outcome::Ok;
            rec.revision = revision;
        }
        Err(error) => {
            rec.outcome = failed_write(&error);
            if rec.outcome == Outcome::Fail {
                rec.completed_us = Some(clients.recorder.now_us());
            }
            rec.error = Some(error_text(&error));
        }
    }
}

async fn cas(
    clients: &Clients,
    process: u64,
    member: u64,
    key: &str,
    from: &str,
    to: &str,
) -> Written {
    let mut kv = KvClient::new(clients.channel(member));
    let mut rec = record(
        process,
        member,
        clients.recorder.now_us(),
        Op::Cas {
            key: key.to_string(),
            from: from.to_string(),
            to: to.to_string(),
        },
    );
    let answer = timed(kv.txn(TxnRequest {
        compare: vec![Compare {
            result: CompareResult::Equal as i32,
            target: CompareTarget::Value as i32,
            key: key.as_bytes().to_vec(),
            range_end: Vec::new(),
            target_union: Some(TargetUnion::Value(from.as_bytes().to_vec())),
        }],
        success: vec![RequestOp {
            request: Some(request_op::Request::RequestPut(PutRequest {
                key: bytes::Bytes::copy_from_slice(key.as_bytes()),
                value: bytes::Bytes::copy_from_slice(to.as_bytes()),
                ..Default::default()
            })),
        }],
        failure: Vec::new(),
    }))
    .await;
    let written = match answer {
        Ok(response) if !response.succeeded => {
            // The compare failed: nothing was written.
            rec.completed_us = Some(clients.recorder.now_us());
            rec.outcome = Outcome::Fail;
            rec.revision = response.header.map(|h| h.revision);
            rec.error = Some("compare failed".into());
            Written::CompareFailed
        }
        answer => {
            finish_write(
                clients,
                &mut rec,
                answer.map(|r| r.header.map(|h| h.revision)),
            );
            Written::of(rec.outcome)
        }
    };
    clients.recorder.push(Record::Op(rec));
    written
}

/// A register client: reads (about 40%), puts (30%) and compare-and-sets
/// (30%) on `keys` registers, pausing `pause_mean` on average before each,
/// until told to stop.
pub async fn register_client(
    clients: Clients,
    process: u64,
    seed: u64,
    keys: u64,
    serializable_reads: bool,
    pause_mean: Duration,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ process.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut member = process % clients.members() + 1;
    // What this client last knew of each register, for its compares.
    let mut known: Vec<Option<String>> = vec![None; keys as usize];
    let mut sequence = 0u64;
    let pause_mean_us = u64::try_from(pause_mean.as_micros()).unwrap_or(u64::MAX);
    while !clients.stopped() {
        // Paced: a pause drawn uniformly from 0 to twice the mean.
        if pause_mean_us > 0 {
            let pause_us = rng.next_u64() % pause_mean_us.saturating_mul(2);
            tokio::time::sleep(Duration::from_micros(pause_us)).await;
        }
        if rng.next_u32() % 32 == 0 {
            member = rng.next_u64() % clients.members() + 1;
        }
        let n = rng.next_u64() % keys;
        let key = register_key(n);
        let draw = rng.next_u32() % 10;
        let ok = if draw < 4 || (draw >= 7 && known[n as usize].is_none()) {
            match get(&clients, process, member, &key, serializable_reads).await {
                Ok(value) => {
                    known[n as usize] = value;
                    true
                }
                Err(()) => false,
            }
        } else {
            sequence += 1;
            let value = unique_value(process, sequence);
            let written = if draw < 7 {
                put(&clients, process, member, &key, &value, None).await
            } else {
                let from = known[n as usize].clone().unwrap_or_default();
                cas(&clients, process, member, &key, &from, &value).await
            };
            match written {
                Written::Ok => {
                    known[n as usize] = Some(value);
                    true
                }
                // What this client knew is stale.
                Written::CompareFailed => {
                    known[n as usize] = None;
                    true
                }
                // NOSPACE, say: back off, as a real client does.
                Written::Refused | Written::Unknown => false,
            }
        };
        if !ok {
            member = member % clients.members() + 1;
            tokio::time::sleep(BACKOFF).await;
        }
    }
}

/// A value no other write of the run uses: the process and its count.
fn unique_value(process: u64, sequence: u64) -> String {
    (process * 1_000_000_000 + sequence).to_string()
}

/// A lease client: grant, attach a key, keep alive for a while, then
/// revoke or let expire, and read the key once the lease is known gone;
/// until told to stop (the lease it holds then is revoked).
pub async fn lease_client(clients: Clients, process: u64, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ process.wrapping_mul(0xd1b5_4a32_d192_ed03));
    let mut member = process % clients.members() + 1;
    let mut sequence = 0u64;
    while !clients.stopped() {
        member = member % clients.members() + 1;
        let Some(lease) = grant(&clients, process, member).await else {
            tokio::time::sleep(BACKOFF).await;
            continue;
        };
        sequence += 1;
        let key = format!("{LEASE_PREFIX}{}", unique_value(process, sequence));
        let value = unique_value(process, sequence);
        put(&clients, process, member, &key, &value, Some(lease)).await;
        // Keep it alive for 0 to 3 s, a keep-alive every half second.
        let keep_alive_rounds = rng.next_u32() % 7;
        for _ in 0..keep_alive_rounds {
            if clients.stopped() {
                break;
            }
            keep_alive(&clients, process, member, lease).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let revoke_it = clients.stopped() || rng.next_u32() % 2 == 0;
        let mut gone = false;
        if revoke_it {
            for _ in 0..5 {
                match revoke(&clients, process, member, lease).await {
                    Some(true) => {
                        gone = true;
                        break;
                    }
                    Some(false) => break,
                    None => member = member % clients.members() + 1,
                }
            }
        }
        // Wait until a member says the lease is gone (it expires within
        // its TTL of the last keep-alive, unless the leader changed, which
        // gives it a full TTL again), at most 30 s.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !gone && tokio::time::Instant::now() < deadline {
            match time_to_live(&clients, process, member, lease).await {
                // -1: gone (0 is a lease whose time is up and whose
                // expiry is not committed yet).
                Some(ttl) if ttl < 0 => gone = true,
                Some(_) => tokio::time::sleep(Duration::from_millis(250)).await,
                None => {
                    member = member % clients.members() + 1;
                    tokio::time::sleep(BACKOFF).await;
                }
            }
        }
        if gone {
            let reader = rng.next_u64() % clients.members() + 1;
            let _ = get(&clients, process, reader, &key, false).await;
        }
    }
}

async fn grant(clients: &Clients, process: u64, member: u64) -> Option<i64> {
    let mut leases = LeaseClient::new(clients.channel(member));
    let mut rec = record(
        process,
        member,
        clients.recorder.now_us(),
        Op::LeaseGrant {
            ttl_secs: LEASE_TTL_SECS,
        },
    );
    let answer = timed(leases.lease_grant(LeaseGrantRequest {
        ttl: LEASE_TTL_SECS,
        id: 0,
    }))
    .await;
    let granted = match answer {
        Ok(response) => {
            rec.completed_us = Some(clients.recorder.now_us());
            rec.outcome = Outcome::Ok;
            rec.revision = response.header.map(|h| h.revision);
            rec.lease = Some(response.id);
            rec.ttl_secs = Some(response.ttl);
            Some(response.id)
        }
        Err(error) => {
            rec.outcome = failed_write(&error);
            rec.error = Some(error_text(&error));
            None
        }
    };
    clients.recorder.push(Record::Op(rec));
    granted
}

async fn keep_alive(clients: &Clients, process: u64, member: u64, lease: i64) {
    let mut leases = LeaseClient::new(clients.channel(member));
    let mut rec = record(
        process,
        member,
        clients.recorder.now_us(),
        Op::LeaseKeepAlive { lease },
    );
    let requests = tokio_stream_once(LeaseKeepAliveRequest { id: lease });
    let answer = tokio::time::timeout(OP_TIMEOUT, async {
        let mut stream = leases.lease_keep_alive(requests).await?.into_inner();
        stream.message().await
    })
    .await;
    match answer {
        Ok(Ok(Some(response))) => {
            rec.completed_us = Some(clients.recorder.now_us());
            rec.outcome = Outcome::Ok;
            rec.ttl_secs = Some(response.ttl);
        }
        Ok(Ok(None)) => rec.error = Some("the stream ended without an answer".into()),
        Ok(Err(status)) => rec.error = Some(error_text(&Some(status))),
        Err(_) => rec.error = Some(error_text(&None)),
    }
    clients.recorder.push(Record::Op(rec));
}

/// A stream of one request that stays open (so the server does not see
/// the client's half closed before it answers).
fn tokio_stream_once<T: Send + 'static>(
    item: T,
) -> tonic::codegen::tokio_stream::wrappers::ReceiverStream<T> {
    let (sender, receiver) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let _ = sender.send(item).await;
        // Held open until the answer came or the request timed out.
        tokio::time::sleep(OP_TIMEOUT).await;
        drop(sender);
    });
    tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(receiver)
}

/// `Some(true)`: revoked; `Some(false)`: the lease was already gone;
/// `None`: no answer.
async fn revoke(clients: &Clients, process: u64, member: u64, lease: i64) -> Option<bool> {
    let mut leases = LeaseClient::new(clients.channel(member));
    let mut rec = record(
        process,
        member,
        clients.recorder.now_us(),
        Op::LeaseRevoke { lease },
    );
    let answer = timed(leases.lease_revoke(LeaseRevokeRequest { id: lease })).await;
    let result = match answer {
        Ok(response) => {
            rec.completed_us = Some(clients.recorder.now_us());
            rec.outcome = Outcome::Ok;
            rec.revision = response.header.map(|h| h.revision);
            Some(true)
        }
        Err(Some(status)) if status.code() == Code::NotFound => {
            rec.completed_us = Some(clients.recorder.now_us());
            rec.outcome = Outcome::Fail;
            rec.error = Some(error_text(&Some(status)));
            Some(false)
        }
        Err(error) => {
            rec.error = Some(error_text(&error));
            None
        }
    };
    clients.recorder.push(Record::Op(rec));
    result
}

/// The TTL a member answers for `lease` (-1: it is gone), or `None`.
async fn time_to_live(clients: &Clients, process: u64, member: u64, lease: i64) -> Option<i64> {
    let mut leases = LeaseClient::new(clients.channel(member));
    let mut rec = record(
        process,
        member,
        clients.recorder.now_us(),
        Op::LeaseTimeToLive { lease },
    );
    let answer = timed(leases.lease_time_to_live(LeaseTimeToLiveRequest {
        id: lease,
        keys: false,
    }))
    .await;
    let ttl = match answer {
        Ok(response) => {
            rec.completed_us = Some(clients.recorder.now_us());
            rec.outcome = Outcome::Ok;
            rec.revision = response.header.map(|h| h.revision);
            rec.ttl_secs = Some(response.ttl);
            Some(response.ttl)
        }
        Err(error) => {
            rec.outcome = Outcome::Fail;
            rec.error = Some(error_text(&error));
            None
        }
    };
    clients.recorder.push(Record::Op(rec));
    ttl
}

/// Disarms every NOSPACE alarm through `member` (as `process`); returns
/// how many were raised (and are now disarmed, unless a disarm failed),
/// or `None` when the member did not list them.
pub async fn disarm_no_space(clients: &Clients, process: u64, member: u64) -> Option<usize> {
    let mut maintenance = MaintenanceClient::new(clients.channel(member));
    let listed = timed(maintenance.alarm(AlarmRequest {
        action: AlarmAction::Get as i32,
        member_id: 0,
        alarm: AlarmType::None as i32,
    }))
    .await
    .ok()?;
    let raised: Vec<u64> = listed
        .alarms
        .iter()
        .filter(|alarm| alarm.alarm == AlarmType::Nospace as i32)
        .map(|alarm| alarm.member_id)
        .collect();
    for member_id in &raised {
        let mut rec = record(
            process,
            member,
            clients.recorder.now_us(),
            Op::DisarmNoSpace,
        );
        let answer = timed(maintenance.alarm(AlarmRequest {
            action: AlarmAction::Deactivate as i32,
            member_id: *member_id,
            alarm: AlarmType::Nospace as i32,
        }))
        .await;
        match answer {
            Ok(response) => {
                rec.completed_us = Some(clients.recorder.now_us());
                rec.outcome = Outcome::Ok;
                rec.revision = response.header.map(|h| h.revision);
            }
            Err(error) => rec.error = Some(error_text(&error)),
        }
        clients.recorder.push(Record::Op(rec));
    }
    Some(raised.len())
}

/// The leader member `member` knows of, and its term.
pub async fn leader_seen_by(clients: &Clients, member: u64) -> Option<(u64, u64)> {
    let mut maintenance = MaintenanceClient::new(clients.channel(member));
    let answer = tokio::time::timeout(
        Duration::from_millis(500),
        maintenance.status(StatusRequest {}),
    )
    .await;
    match answer {
        Ok(Ok(response)) => {
            let status = response.into_inner();
            (status.leader != 0).then_some((status.leader, status.raft_term))
        }
        _ => None,
    }
}

/// The leader of the highest term any member reports.
pub async fn leader(clients: &Clients) -> Option<u64> {
    let mut best: Option<(u64, u64)> = None;
    for member in 1..=clients.members() {
        if let Some((leader, term)) = leader_seen_by(clients, member).await {
            if best.is_none_or(|(_, best_term)| term > best_term) {
                best = Some((leader, term));
            }
        }
    }
    best.map(|(leader, _)| leader)
}

/// HashKV of member `member` at `revision` (`None` when it did not answer).
pub async fn hash_kv(clients: &Clients, member: u64, revision: i64) -> Option<u32> {
    let mut maintenance = MaintenanceClient::new(clients.channel(member));
    timed(maintenance.hash_kv(HashKvRequest { revision }))
        .await
        .ok()
        .map(|response| response.hash)
}

/// What a watcher is told to do once the clients have stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchTarget {
    /// Keep watching.
    Running,
    /// Reach this revision (every event through it delivered, or a
    /// progress notification at or past it), then close.
    CatchUpTo(i64),
}

/// How a watcher ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatcherEnd {
    /// The watcher.
    pub watcher: u64,
    /// The revision through which it knows every event.
    pub covered_revision: i64,
    /// Whether it reached the revision it was told to.
    pub caught_up: bool,
}

/// A watcher: watches every key of the test from revision 1, through
/// member after member, until told to catch up to a revision and done so
/// (or `deadline` after that order).
pub async fn watcher(
    clients: Clients,
    watcher: u64,
    seed: u64,
    mut target: watch::Receiver<WatchTarget>,
    catch_up_within: Duration,
) -> WatcherEnd {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ watcher.wrapping_mul(0xa076_1d64_78bd_642f));
    let mut member = watcher % clients.members() + 1;
    let mut covered: i64 = 0;
    let mut catch_up_deadline: Option<tokio::time::Instant> = None;
    loop {
        if let WatchTarget::CatchUpTo(revision) = *target.borrow() {
            if covered >= revision {
                return WatcherEnd {
                    watcher,
                    covered_revision: covered,
                    caught_up: true,
                };
            }
            let deadline = *catch_up_deadline
                .get_or_insert_with(|| tokio::time::Instant::now() + catch_up_within);
            if tokio::time::Instant::now() >= deadline {
                return WatcherEnd {
                    watcher,
                    covered_revision: covered,
                    caught_up: false,
                };
            }
        }
        // A stream is kept for 2 to 8 s before the watcher closes it on
        // purpose and resumes elsewhere.
        let lifetime = Duration::from_millis(2000 + rng.next_u64() % 6000);
        covered = watch_stream(&clients, watcher, member, covered, lifetime, &mut target).await;
        member = member % clients.members() + 1;
    }
}

/// One watch stream on `member` from `covered + 1`; returns the revision
/// through which the watcher then knows every event.
async fn watch_stream(
    clients: &Clients,
    watcher: u64,
    member: u64,
    mut covered: i64,
    lifetime: Duration,
    target: &mut watch::Receiver<WatchTarget>,
) -> i64 {
    let note = |step: WatchStep| {
        clients.recorder.push(Record::Watch(WatchRecord {
            watcher,
            at_us: clients.recorder.now_us(),
            event: step,
        }))
    };
    let start_revision = covered + 1;
    note(WatchStep::Open {
        member,
        start_revision,
    });
    let (requests, receiver) = tokio::sync::mpsc::channel(8);
    let create = WatchRequest {
        request_union: Some(watch_request::RequestUnion::CreateRequest(
            WatchCreateRequest {
                key: WATCH_FROM.as_bytes().to_vec(),
                range_end: WATCH_END.as_bytes().to_vec(),
                start_revision,
                progress_notify: true,
                ..Default::default()
            },
        )),
    };
    let _ = requests.send(create).await;
    let mut client = WatchClient::new(clients.channel(member));
    let opened = tokio::time::timeout(
        OP_TIMEOUT,
        client.watch(tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(
            receiver,
        )),
    )
    .await;
    let mut stream = match opened {
        Ok(Ok(response)) => response.into_inner(),
        Ok(Err(status)) => {
            note(WatchStep::Closed {
                reason: error_text(&Some(status)),
                deliberate: false,
            });
            tokio::time::sleep(BACKOFF).await;
            return covered;
        }
        Err(_) => {
            note(WatchStep::Closed {
                reason: error_text(&None),
                deliberate: false,
            });
            return covered;
        }
    };
    let closes_at = tokio::time::Instant::now() + lifetime;
    let mut last_answer = tokio::time::Instant::now();
    let mut progress = tokio::time::interval(PROGRESS_EVERY);
    progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let target_now = *target.borrow();
        if let WatchTarget::CatchUpTo(revision) = target_now {
            if covered >= revision {
                note(WatchStep::Closed {
                    reason: format!("caught up to revision {revision}"),
                    deliberate: true,
                });
                return covered;
            }
        } else if tokio::time::Instant::now() >= closes_at {
            note(WatchStep::Closed {
                reason: "resuming on another member".into(),
                deliberate: true,
            });
            return covered;
        }
        if last_answer.elapsed() > WATCH_SILENCE_MAX {
            note(WatchStep::Closed {
                reason: format!(
                    "no answer for {} ms while progress was asked",
                    WATCH_SILENCE_MAX.as_millis()
                ),
                deliberate: false,
            });
            return covered;
        }
        tokio::select! {
            message = stream.message() => {
                last_answer = tokio::time::Instant::now();
                match message {
                    Ok(Some(response)) => {
                        let header_revision = response.header.as_ref().map_or(0, |h| h.revision);
                        if response.created {
                            note(WatchStep::Created);
                        } else if response.canceled {
                            note(WatchStep::Cancelled {
                                reason: response.cancel_reason.clone(),
                                compact_revision: response.compact_revision,
                            });
                            return covered;
                        } else if response.events.is_empty() {
                            note(WatchStep::Progress { revision: header_revision });
                            covered = covered.max(header_revision);
                        } else {
                            let events: Vec<WatchEvent> = response
                                .events
                                .iter()
                                .map(|event| {
                                    let kv = event.kv.clone().unwrap_or_default();
                                    WatchEvent {
                                        revision: kv.mod_revision,
                                        key: String::from_utf8_lossy(&kv.key).into_owned(),
                                        delete: event.r#type == EventType::Delete as i32,
                                        value: String::from_utf8_lossy(&kv.value).into_owned(),
                                        lease: kv.lease,
                                    }
                                })
                                .collect();
                            let last = events.iter().map(|e| e.revision).max().unwrap_or(0);
                            note(WatchStep::Events { header_revision, events });
                            covered = covered.max(last);
                        }
                    }
                    Ok(None) => {
                        note(WatchStep::Closed { reason: "the stream ended".into(), deliberate: false });
                        return covered;
                    }
                    Err(status) => {
                        note(WatchStep::Closed { reason: error_text(&Some(status)), deliberate: false });
                        tokio::time::sleep(BACKOFF).await;
                        return covered;
                    }
                }
            }
            _ = progress.tick() => {
                let request = WatchRequest {
                    request_union: Some(watch_request::RequestUnion::ProgressRequest(
                        WatchProgressRequest {},
                    )),
                };
                // A full queue means the member is not reading: the
                // silence check above ends the stream.
                let _ = requests.try_send(request);
            }
            _ = target.changed() => {}
        }
    }
}
