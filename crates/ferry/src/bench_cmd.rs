//! `ferry bench`: a load generator that speaks the etcd v3 gRPC API, so
//! that the same run measures ferry and etcd alike.
//!
//! It opens `--connections` HTTP/2 connections, round-robin over the
//! endpoints, and runs `--clients` request loops spread round-robin over the
//! connections; each loop keeps one request in flight. Keys are drawn
//! uniformly from the key space by a ChaCha8 generator per loop, seeded from
//! `--seed`, so each loop asks for the same keys in every run (how many
//! requests each loop sends depends on timing). The range workloads first put every
//! key of the key space once (the load phase) and then check every read
//! against the value the load phase wrote: a benchmark that does not look at
//! its answers can measure a server that answers wrongly.
//!
//! A failed request is counted under its kind (the gRPC status code, a
//! timeout, or a read that did not return the loaded value) and never stops
//! the run. Latencies of successful requests go into an HDR histogram in
//! microseconds.

use std::collections::BTreeMap;
use std::fmt;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_server::grpc_client::GrpcChannel;
use ferry_server::pb::etcdserverpb::kv_client::KvClient;
use ferry_server::pb::etcdserverpb::{PutRequest, RangeRequest, RangeResponse};
use hdrhistogram::Histogram;

use crate::bench_watch::{WatchOutcome, Watchers, STAMP_BYTES, WATCHERS_MAX};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tonic::transport::Endpoint;

/// Connections one run may open: far above what one machine benchmarks
/// usefully, low enough that a typo does not exhaust file descriptors.
pub const CONNECTIONS_MAX: usize = 1024;
/// Request loops one run may start (each is a tokio task).
pub const CLIENTS_MAX: usize = 100_000;
/// Largest key: etcd has no fixed key limit, but keys count against the
/// request size limit and a benchmark of huge keys measures something else.
pub const KEY_BYTES_MAX: usize = 4096;
/// Largest value: 1 MiB, below both servers' default request limit
/// (1.5 MiB) with room for the key and framing.
pub const VALUE_BYTES_MAX: usize = 1024 * 1024;
/// Largest latency the histogram holds, in microseconds (one minute); a
/// slower answer is recorded as this value.
const LATENCY_US_MAX: u64 = 60_000_000;
/// How long to wait for each connection to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the serializable workload waits, after the load phase, for
/// every member to have applied it.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often it asks meanwhile.
const SETTLE_POLL: Duration = Duration::from_millis(2);

/// What each measured request does.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// Put one key of the key space to its value (a write through the log).
    Put,
    /// Read one key with a linearizable range (etcd's default read).
    RangeLinearizable,
    /// Read one key with a serializable range (served from the member's own
    /// replica, after every member has applied the load phase).
    RangeSerializable,
    /// Put every key of the key space once, in order, and measure that (to
    /// fill a store before another run: `--requests` and the warm-up do not
    /// apply).
    Fill,
}

impl Workload {
    /// Whether the workload reads, and so needs the key space loaded first.
    fn reads(self) -> bool {
        match self {
            Workload::Put | Workload::Fill => false,
            Workload::RangeLinearizable | Workload::RangeSerializable => true,
        }
    }

    /// The name the command line uses.
    fn name(self) -> &'static str {
        match self {
            Workload::Put => "put",
            Workload::RangeLinearizable => "range-linearizable",
            Workload::RangeSerializable => "range-serializable",
            Workload::Fill => "fill",
        }
    }
}

/// Arguments of `ferry bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The servers' client endpoints, comma-separated `host:port` (an
    /// `http://` prefix is accepted). Connections go round-robin over them.
    #[arg(
        long,
        value_name = "HOST:PORT,...",
        default_value = "127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379"
    )]
    pub endpoints: String,
    /// gRPC (HTTP/2) connections to open, spread round-robin over the endpoints.
    #[arg(long, value_name = "N", default_value_t = 6)]
    pub connections: usize,
    /// Requests in flight at once: each client is a loop with one request
    /// outstanding, and the clients are spread round-robin over the connections.
    #[arg(long, value_name = "N", default_value_t = 60)]
    pub clients: usize,
    /// Measured requests in total, over all clients.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub requests: u64,
    /// What each request does. The range workloads first put every key of
    /// the key space once and check each read against that value.
    #[arg(long, value_enum, default_value_t = Workload::Put)]
    pub workload: Workload,
    /// Distinct keys; each request picks one uniformly at random.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub key_space: u64,
    /// Size of every key in bytes (`k` and a zero-padded number, so it must
    /// leave room for the digits of the largest key).
    #[arg(long, value_name = "BYTES", default_value_t = 8)]
    pub key_bytes: usize,
    /// Size of every value in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 256)]
    pub value_bytes: usize,
    /// Requests of the workload run before measuring (after the load
    /// phase), to open streams and warm caches; not counted.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub warmup_requests: u64,
    /// Seed of the key choice: with the same seed each client asks for the
    /// same sequence of keys.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// How long one request may take before it counts as a timeout error.
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Watchers of single keys to keep open during the run: watcher i
    /// watches key i (keys past the key space get no events). Each
    /// measured put then carries its send time, and the time to each of
    /// its events is reported.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub watchers: u64,
    /// Watchers of the prefix every benchmark key has (each sees every
    /// put).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub prefix_watchers: u64,
}

impl Default for BenchArgs {
    /// The command-line defaults.
    fn default() -> Self {
        BenchArgs {
            endpoints: "127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379".to_string(),
            connections: 6,
            clients: 60,
            requests: 10_000,
            workload: Workload::Put,
            key_space: 1000,
            key_bytes: 8,
            value_bytes: 256,
            warmup_requests: 1000,
            seed: 1,
            timeout_ms: 10_000,
            watchers: 0,
            prefix_watchers: 0,
        }
    }
}

/// Why a benchmark could not run. Failed requests are not errors of this
/// kind: they are counted in the report.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// No endpoint given.
    #[error("--endpoints is empty: give at least one host:port, e.g. 127.0.0.1:2379")]
    NoEndpoints,
    /// An endpoint that is not `host:port`.
    #[error("--endpoints: {endpoint:?} is not host:port or http://host:port ({reason})")]
    BadEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A count that must be positive is zero.
    #[error("--{option} is 0; it must be at least 1")]
    Zero {
        /// The option's long name.
        option: &'static str,
    },
    /// A value above the limit of its option.
    #[error("--{option} {value} is above the limit of {max}")]
    TooLarge {
        /// The option's long name.
        option: &'static str,
        /// The value given.
        value: u64,
        /// The largest value accepted.
        max: u64,
    },
    /// Connections that would have no client to use them.
    #[error(
        "--connections {connections} is more than --clients {clients}: every connection needs \
         at least one client; lower --connections or raise --clients"
    )]
    MoreConnectionsThanClients {
        /// Connections asked for.
        connections: usize,
        /// Clients asked for.
        clients: usize,
    },
    /// Keys too short to tell the key space apart.
    #[error(
        "--key-bytes {key_bytes} cannot hold {key_space} distinct keys: a key is `k` and \
         {digits} digits, so --key-bytes must be at least {needed} (or lower --key-space)"
    )]
    KeysTooShort {
        /// Key size asked for.
        key_bytes: usize,
        /// Key space asked for.
        key_space: u64,
        /// Digits of the largest key number.
        digits: usize,
        /// The smallest key size that fits.
        needed: usize,
    },
    /// Watchers asked for with values too short to carry a send time.
    #[error(
        "--value-bytes {value_bytes} is too short for --watchers: each value carries its send \
         time in its first {needed} bytes"
    )]
    ValueTooShortForWatchers {
        /// Value size asked for.
        value_bytes: usize,
        /// The smallest value size that fits.
        needed: usize,
    },
    /// A watch stream failed or its watchers were not created.
    #[error("watchers: {0}")]
    Watch(String),
    /// An endpoint that did not accept a connection.
    #[error("cannot connect to {endpoint}: {reason} (is the server running?)")]
    Connect {
        /// The endpoint URL.
        endpoint: String,
        /// The transport error and its causes.
        reason: String,
    },
    /// The async runtime could not start.
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    /// A broken invariant of the benchmark itself (a request loop that
    /// panicked, a histogram that cannot be made).
    #[error("internal error of the benchmark: {0}")]
    Internal(String),
}

/// A validated benchmark: what [`run_bench`] runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchPlan {
    /// Endpoint URLs (`http://host:port`).
    pub endpoints: Vec<String>,
    /// Connections to open.
    pub connections: usize,
    /// Request loops.
    pub clients: usize,
    /// Measured requests.
    pub requests: u64,
    /// What each request does.
    pub workload: Workload,
    /// Distinct keys.
    pub key_space: u64,
    /// Key size in bytes.
    pub key_bytes: usize,
    /// Value size in bytes.
    pub value_bytes: usize,
    /// Unmeasured requests before the measured ones.
    pub warmup_requests: u64,
    /// Seed of the key choice.
    pub seed: u64,
    /// Time one request may take.
    pub timeout: Duration,
    /// Watchers of single keys.
    pub watchers: u64,
    /// Watchers of the prefix of every key.
    pub prefix_watchers: u64,
}

impl BenchPlan {
    /// Requests of the measured phase: every key once for a fill,
    /// `--requests` otherwise.
    pub fn measured_requests(&self) -> u64 {
        match self.workload {
            Workload::Fill => self.key_space,
            Workload::Put | Workload::RangeLinearizable | Workload::RangeSerializable => {
                self.requests
            }
        }
    }
}

/// Turns `host:port` or `http://host:port` into a URL tonic can dial.
fn endpoint_url(text: &str) -> Result<String, BenchError> {
    let bad = |reason: &str| BenchError::BadEndpoint {
        endpoint: text.to_string(),
        reason: reason.to_string(),
    };
    if text.starts_with("https://") {
        return Err(bad("TLS is not supported; use http:// or host:port"));
    }
    let authority = text.strip_prefix("http://").unwrap_or(text);
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    let (host, port) = authority.rsplit_once(':').ok_or_else(|| bad("no :port"))?;
    if host.is_empty() {
        return Err(bad("no host"));
    }
    if host.contains('/') || host.contains(char::is_whitespace) {
        return Err(bad("the host has a path or a space in it"));
    }
    match port.parse::<u16>() {
        Ok(0) | Err(_) => return Err(bad("the port is not a number from 1 to 65535")),
        Ok(_) => {}
    }
    Ok(format!("http://{authority}"))
}

/// Decimal digits of `n` (1 for 0).
fn decimal_digits(mut n: u64) -> usize {
    let mut digits = 1;
    while n >= 10 {
        n /= 10;
        digits += 1;
    }
    digits
}

/// Checks the arguments and turns them into a plan.
pub fn plan(args: &BenchArgs) -> Result<BenchPlan, BenchError> {
    let endpoints = args
        .endpoints
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(endpoint_url)
        .collect::<Result<Vec<_>, _>>()?;
    if endpoints.is_empty() {
        return Err(BenchError::NoEndpoints);
    }
    for (option, value) in [
        ("connections", args.connections as u64),
        ("clients", args.clients as u64),
        ("requests", args.requests),
        ("key-space", args.key_space),
        ("key-bytes", args.key_bytes as u64),
        ("timeout-ms", args.timeout_ms),
    ] {
        if value == 0 {
            return Err(BenchError::Zero { option });
        }
    }
    for (option, value, max) in [
        ("connections", args.connections, CONNECTIONS_MAX),
        ("clients", args.clients, CLIENTS_MAX),
        ("key-bytes", args.key_bytes, KEY_BYTES_MAX),
        ("value-bytes", args.value_bytes, VALUE_BYTES_MAX),
        (
            "watchers",
            usize::try_from(args.watchers).unwrap_or(usize::MAX),
            WATCHERS_MAX as usize,
        ),
        (
            "prefix-watchers",
            usize::try_from(args.prefix_watchers).unwrap_or(usize::MAX),
            WATCHERS_MAX as usize,
        ),
    ] {
        if value > max {
            return Err(BenchError::TooLarge {
                option,
                value: value as u64,
                max: max as u64,
            });
        }
    }
    if args.connections > args.clients {
        return Err(BenchError::MoreConnectionsThanClients {
            connections: args.connections,
            clients: args.clients,
        });
    }
    let watching = args.watchers.saturating_add(args.prefix_watchers);
    if watching > WATCHERS_MAX {
        return Err(BenchError::TooLarge {
            option: "watchers",
            value: watching,
            max: WATCHERS_MAX,
        });
    }
    if watching > 0 && args.value_bytes < STAMP_BYTES {
        return Err(BenchError::ValueTooShortForWatchers {
            value_bytes: args.value_bytes,
            needed: STAMP_BYTES,
        });
    }
    // Watched keys beyond the key space are keys too.
    let digits = decimal_digits(args.key_space.max(args.watchers) - 1);
    if args.key_bytes < digits + 1 {
        return Err(BenchError::KeysTooShort {
            key_bytes: args.key_bytes,
            key_space: args.key_space,
            digits,
            needed: digits + 1,
        });
    }
    Ok(BenchPlan {
        endpoints,
        connections: args.connections,
        clients: args.clients,
        requests: args.requests,
        workload: args.workload,
        key_space: args.key_space,
        key_bytes: args.key_bytes,
        value_bytes: args.value_bytes,
        warmup_requests: args.warmup_requests,
        seed: args.seed,
        timeout: Duration::from_millis(args.timeout_ms),
        watchers: args.watchers,
        prefix_watchers: args.prefix_watchers,
    })
}

/// The key of number `index`: `k` and the number zero-padded to `key_bytes`.
pub fn key_for(index: u64, key_bytes: usize) -> Vec<u8> {
    let digits = key_bytes.saturating_sub(1);
    format!("k{index:0digits$}").into_bytes()
}

/// The value the benchmark writes under key number `index`: the number, a
/// dot, then filler, cut or padded to `value_bytes`. Values differ between
/// keys (when there is room for the number), so a read that returns another
/// key's value is caught.
pub fn value_for(index: u64, value_bytes: usize) -> Vec<u8> {
    let mut value = format!("{index}.").into_bytes();
    value.resize(value_bytes, b'v');
    value
}

/// Why one request counts as failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The server (or the transport) answered with this gRPC status.
    Status(tonic::Code),
    /// No answer within the request timeout.
    Timeout,
    /// A read found no value under a key the load phase wrote.
    MissingKey,
    /// A read found another value than the load phase wrote.
    WrongValue,
    /// A read of one key returned other or more keys.
    UnexpectedKeys,
}

impl FailureKind {
    /// The order reports list kinds in: statuses by code, then the others.
    fn sort_key(self) -> (u8, i32) {
        match self {
            FailureKind::Status(code) => (0, i32::from(code)),
            FailureKind::Timeout => (1, 0),
            FailureKind::MissingKey => (2, 0),
            FailureKind::WrongValue => (3, 0),
            FailureKind::UnexpectedKeys => (4, 0),
        }
    }
}

impl Ord for FailureKind {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.sort_key().cmp(&other.sort_key())
    }
}

impl PartialOrd for FailureKind {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureKind::Status(code) => write!(f, "{code:?}"),
            FailureKind::Timeout => f.write_str("Timeout"),
            FailureKind::MissingKey => f.write_str("MissingKey"),
            FailureKind::WrongValue => f.write_str("WrongValue"),
            FailureKind::UnexpectedKeys => f.write_str("UnexpectedKeys"),
        }
    }
}

/// How often one kind of failure happened, with its first message so that a
/// person can tell what went wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureCount {
    /// Requests that failed this way.
    pub count: u64,
    /// The message of the first of them.
    pub first_message: String,
}

/// Checks a one-key range response against the loaded value.
pub fn check_read(
    response: &RangeResponse,
    key: &[u8],
    expected_value: &[u8],
) -> Result<(), (FailureKind, String)> {
    let shown = String::from_utf8_lossy(key);
    match response.kvs.as_slice() {
        [] => Err((
            FailureKind::MissingKey,
            format!("key {shown} not found (count {})", response.count),
        )),
        [kv] if kv.key != key => Err((
            FailureKind::UnexpectedKeys,
            format!(
                "asked for key {shown}, got key {}",
                String::from_utf8_lossy(&kv.key)
            ),
        )),
        [kv] if kv.value != expected_value => Err((
            FailureKind::WrongValue,
            format!(
                "key {shown}: expected a value of {} bytes starting {:?}, got {} bytes starting {:?}",
                expected_value.len(),
                String::from_utf8_lossy(&expected_value[..expected_value.len().min(16)]),
                kv.value.len(),
                String::from_utf8_lossy(&kv.value[..kv.value.len().min(16)]),
            ),
        )),
        [_] => Ok(()),
        many => Err((
            FailureKind::UnexpectedKeys,
            format!("asked for key {shown}, got {} keys", many.len()),
        )),
    }
}

/// What one phase (load, warm-up or measurement) did.
#[derive(Debug, Clone)]
pub struct PhaseOutcome {
    /// Requests sent (succeeded + failed).
    pub requests: u64,
    /// Requests that succeeded (for reads: and returned the loaded value).
    pub succeeded: u64,
    /// Failed requests by kind.
    pub failures: BTreeMap<FailureKind, FailureCount>,
    /// Latency of every successful request, in microseconds.
    pub latency_us: Histogram<u64>,
    /// Wall time of the phase.
    pub elapsed: Duration,
    /// The highest store revision a successful answer carried in its header.
    pub revision_max: i64,
}

impl PhaseOutcome {
    /// Failed requests of every kind.
    pub fn errors(&self) -> u64 {
        self.failures.values().map(|f| f.count).sum()
    }

    /// Successful requests per second of wall time.
    pub fn requests_per_second(&self) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            self.succeeded as f64 / seconds
        } else {
            0.0
        }
    }
}

/// What one request loop counted in a phase (its latencies go to the
/// phase's shared histogram: one histogram per loop would cost a few hundred
/// KiB per client).
#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    succeeded: u64,
    failures: BTreeMap<FailureKind, FailureCount>,
    revision_max: i64,
}

impl Tally {
    fn fail(&mut self, kind: FailureKind, message: String) {
        self.failures
            .entry(kind)
            .and_modify(|f| f.count += 1)
            .or_insert(FailureCount {
                count: 1,
                first_message: message,
            });
    }

    fn absorb(&mut self, other: Tally) {
        self.requests += other.requests;
        self.succeeded += other.succeeded;
        self.revision_max = self.revision_max.max(other.revision_max);
        for (kind, failure) in other.failures {
            self.failures
                .entry(kind)
                .and_modify(|f| f.count += failure.count)
                .or_insert(failure);
        }
    }
}

/// An empty latency histogram in microseconds, 3 significant digits.
pub(crate) fn latency_histogram() -> Result<Histogram<u64>, BenchError> {
    Histogram::<u64>::new_with_bounds(1, LATENCY_US_MAX, 3)
        .map_err(|error| BenchError::Internal(format!("histogram: {error:?}")))
}

/// The wait, before serializable reads, for every member to apply the load
/// phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Not a serializable workload: no wait (a linearizable read must see
    /// every acknowledged write without one).
    NotNeeded,
    /// How long it took, or `None` if some member had not applied the load
    /// phase within the settle timeout.
    Waited(Option<Duration>),
}

impl fmt::Display for Settle {
    /// `na`, `timeout` or the wait in milliseconds.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Settle::NotNeeded => f.write_str("na"),
            Settle::Waited(None) => f.write_str("timeout"),
            Settle::Waited(Some(waited)) => write!(f, "{}", waited.as_millis()),
        }
    }
}

/// Everything a run measured.
#[derive(Debug, Clone)]
pub struct BenchReport {
    /// The plan that ran.
    pub plan: BenchPlan,
    /// The load phase of a range workload (every key put once).
    pub load: Option<PhaseOutcome>,
    /// The wait for every member to apply the load phase.
    pub settle: Settle,
    /// The measured phase.
    pub measured: PhaseOutcome,
    /// What the watchers saw, when the run had any.
    pub watch: Option<WatchOutcome>,
}

/// Which requests a phase sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PhaseKind {
    /// Put key 0, 1, ... key_space - 1, each once, with its value.
    Load,
    /// The workload, on uniformly random keys.
    Workload,
}

/// `count` clients over `channels`, spread round-robin.
fn kv_clients(channels: &[GrpcChannel], count: usize) -> Vec<KvClient<GrpcChannel>> {
    channels
        .iter()
        .cycle()
        .take(count)
        .map(|channel| KvClient::new(channel.clone()))
        .collect()
}

/// Opens the connections, round-robin over the endpoints.
async fn connect(plan: &BenchPlan) -> Result<Vec<GrpcChannel>, BenchError> {
    let mut channels = Vec::with_capacity(plan.connections);
    for index in 0..plan.connections {
        let url = &plan.endpoints[index % plan.endpoints.len()];
        let connect_error = |reason: String| BenchError::Connect {
            endpoint: url.clone(),
            reason,
        };
        let endpoint = Endpoint::from_shared(url.clone())
            .map_err(|error| connect_error(error_chain(&error)))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        let channel = endpoint
            .connect()
            .await
            .map_err(|error| connect_error(error_chain(&error)))?;
        channels.push(GrpcChannel::new(channel));
    }
    Ok(channels)
}

/// An error and its causes on one line.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Runs one phase of `total` requests over the clients. The clients take the
/// next request number from a shared counter, so a slow client does not
/// leave the others idle at the end.
async fn run_phase(
    plan: &BenchPlan,
    clients: &[KvClient<GrpcChannel>],
    kind: PhaseKind,
    total: u64,
    seed: u64,
    progress: &ProgressBar,
) -> Result<PhaseOutcome, BenchError> {
    let next = Arc::new(AtomicU64::new(0));
    let latency_us = Arc::new(Mutex::new(latency_histogram()?));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(clients.len());
    for (index, client) in clients.iter().enumerate() {
        let mut client = client.clone();
        let next = next.clone();
        let latency_us = latency_us.clone();
        let progress = progress.clone();
        let plan = plan.clone();
        // One generator per client, each from its own seed, so that a
        // client's sequence of keys does not depend on the other clients.
        let mut rng =
            ChaCha8Rng::seed_from_u64(seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        // Measured puts carry their send time while watchers time them.
        let stamped = plan.watchers + plan.prefix_watchers > 0
            && kind == PhaseKind::Workload
            && !plan.workload.reads();
        tasks.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            loop {
                let number = next.fetch_add(1, Ordering::Relaxed);
                if number >= total {
                    break;
                }
                let key_index = match kind {
                    PhaseKind::Load => number,
                    PhaseKind::Workload => uniform(&mut rng, plan.key_space),
                };
                let key = key_for(key_index, plan.key_bytes);
                let mut value = value_for(key_index, plan.value_bytes);
                if stamped {
                    crate::bench_watch::stamp(&mut value);
                }
                let sent = Instant::now();
                let result = one_request(&mut client, &plan, kind, key, &value).await;
                let latency = sent.elapsed();
                tally.requests += 1;
                match result {
                    Ok(revision) => {
                        tally.succeeded += 1;
                        tally.revision_max = tally.revision_max.max(revision);
                        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
                        // A loop that panicked while holding the lock left
                        // a histogram that is still whole: record on.
                        latency_us
                            .lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner())
                            .saturating_record(micros.max(1));
                    }
                    Err((failure, message)) => tally.fail(failure, message),
                }
                progress.inc(1);
            }
            tally
        }));
    }
    let mut merged = Tally::default();
    for task in tasks {
        let tally = task
            .await
            .map_err(|error| BenchError::Internal(format!("a request loop failed: {error}")))?;
        merged.absorb(tally);
    }
    let elapsed = started.elapsed();
    let latency_us = latency_us
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone();
    Ok(PhaseOutcome {
        requests: merged.requests,
        succeeded: merged.succeeded,
        failures: merged.failures,
        latency_us,
        elapsed,
        revision_max: merged.revision_max,
    })
}

/// A uniform number in `0..bound` (`bound` > 0), without modulo bias.
fn uniform(rng: &mut ChaCha8Rng, bound: u64) -> u64 {
    debug_assert!(bound > 0);
    let zone = u64::MAX - (u64::MAX % bound);
    loop {
        let draw = rng.next_u64();
        if draw < zone {
            return draw % bound;
        }
    }
}

/// Sends one request and judges its answer; returns the store revision in
/// the answer's header (0 without a header).
async fn one_request(
    client: &mut KvClient<GrpcChannel>,
    plan: &BenchPlan,
    kind: PhaseKind,
    key: Vec<u8>,
    value: &[u8],
) -> Result<i64, (FailureKind, String)> {
    let write = match kind {
        PhaseKind::Load => true,
        PhaseKind::Workload => !plan.workload.reads(),
    };
    let timed_out = || {
        (
            FailureKind::Timeout,
            format!("no answer within {} ms", plan.timeout.as_millis()),
        )
    };
    let status = |status: tonic::Status| {
        (
            FailureKind::Status(status.code()),
            status.message().to_string(),
        )
    };
    if write {
        let request = PutRequest {
            key: key.into(),
            value: bytes::Bytes::copy_from_slice(value),
            ..Default::default()
        };
        match tokio::time::timeout(plan.timeout, client.put(request)).await {
            Err(_) => Err(timed_out()),
            Ok(Err(error)) => Err(status(error)),
            Ok(Ok(response)) => Ok(response.get_ref().header.as_ref().map_or(0, |h| h.revision)),
        }
    } else {
        let request = RangeRequest {
            key: key.clone(),
            serializable: plan.workload == Workload::RangeSerializable,
            ..Default::default()
        };
        match tokio::time::timeout(plan.timeout, client.range(request)).await {
            Err(_) => Err(timed_out()),
            Ok(Err(error)) => Err(status(error)),
            Ok(Ok(response)) => {
                let response = response.get_ref();
                check_read(response, &key, value)?;
                Ok(response.header.as_ref().map_or(0, |h| h.revision))
            }
        }
    }
}

/// Waits until every connection's member answers a serializable read at
/// `revision` or later, that is, has applied the load phase. Serializable
/// reads may be stale by design; without this wait, reads right after the
/// load phase could miss keys on a member that has not applied them yet, and
/// count as errors that are not. Returns how long it took, or `None` when
/// some member had not got there within `timeout`.
pub async fn wait_until_applied(
    channels: &[GrpcChannel],
    revision: i64,
    timeout: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    let deadline = started + timeout;
    for channel in channels {
        let mut client = KvClient::new(channel.clone());
        loop {
            let request = RangeRequest {
                key: key_for(0, 1),
                serializable: true,
                count_only: true,
                ..Default::default()
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let applied = match tokio::time::timeout(left, client.range(request)).await {
                Ok(Ok(response)) => response
                    .get_ref()
                    .header
                    .as_ref()
                    .is_some_and(|h| h.revision >= revision),
                // A failed read is asked again until the deadline.
                Ok(Err(_)) | Err(_) => false,
            };
            if applied {
                break;
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
    }
    Some(started.elapsed())
}

/// Connects, loads the key space for a range workload, warms up, and
/// measures. `progress` counts measured requests.
pub async fn run_bench(
    plan: &BenchPlan,
    progress: &ProgressBar,
) -> Result<BenchReport, BenchError> {
    let channels = connect(plan).await?;
    let clients = kv_clients(&channels, plan.clients);
    let quiet = ProgressBar::hidden();
    let load = if plan.workload.reads() {
        Some(
            run_phase(
                plan,
                &clients,
                PhaseKind::Load,
                plan.key_space,
                plan.seed,
                &quiet,
            )
            .await?,
        )
    } else {
        None
    };
    let settle = match (&load, plan.workload) {
        (Some(load), Workload::RangeSerializable) => {
            Settle::Waited(wait_until_applied(&channels, load.revision_max, SETTLE_TIMEOUT).await)
        }
        _ => Settle::NotNeeded,
    };
    if plan.workload == Workload::Fill {
        let measured = run_phase(
            plan,
            &clients,
            PhaseKind::Load,
            plan.measured_requests(),
            plan.seed,
            progress,
        )
        .await?;
        return Ok(BenchReport {
            plan: plan.clone(),
            load,
            settle,
            measured,
            watch: None,
        });
    }
    let watchers = if plan.watchers + plan.prefix_watchers > 0 {
        Some(Watchers::start(plan, &channels).await?)
    } else {
        None
    };
    if plan.warmup_requests > 0 {
        // Another seed than the measurement, so the two do not ask for the
        // same keys in the same order.
        run_phase(
            plan,
            &clients,
            PhaseKind::Workload,
            plan.warmup_requests,
            !plan.seed,
            &quiet,
        )
        .await?;
    }
    if let Some(watchers) = &watchers {
        watchers.measure();
    }
    let measured = run_phase(
        plan,
        &clients,
        PhaseKind::Workload,
        plan.requests,
        plan.seed,
        progress,
    )
    .await?;
    let watch = match watchers {
        Some(watchers) => Some(watchers.finish().await),
        None => None,
    };
    Ok(BenchReport {
        plan: plan.clone(),
        load,
        settle,
        measured,
        watch,
    })
}

/// The latency at `quantile` in microseconds (0 with no sample).
fn quantile_us(histogram: &Histogram<u64>, quantile: f64) -> u64 {
    if histogram.is_empty() {
        0
    } else {
        histogram.value_at_quantile(quantile)
    }
}

/// Failure kinds as `Kind:count,Kind:count` (`none` without failures).
fn failure_list(failures: &BTreeMap<FailureKind, FailureCount>) -> String {
    if failures.is_empty() {
        return "none".to_string();
    }
    failures
        .iter()
        .map(|(kind, failure)| format!("{kind}:{}", failure.count))
        .collect::<Vec<_>>()
        .join(",")
}

/// The summary for a person.
pub fn human_summary(report: &BenchReport) -> String {
    let plan = &report.plan;
    let measured = &report.measured;
    let histogram = &measured.latency_us;
    let mut text = String::new();
    text.push_str(&format!(
        "workload     {} ({} connections to {}, {} clients, {} keys of {} bytes, values of {} bytes)\n",
        plan.workload.name(),
        plan.connections,
        plan.endpoints.join(","),
        plan.clients,
        plan.key_space,
        plan.key_bytes,
        plan.value_bytes,
    ));
    if let Some(load) = &report.load {
        text.push_str(&format!(
            "load phase   {} puts in {:.3} s, {} errors\n",
            load.requests,
            load.elapsed.as_secs_f64(),
            load.errors()
        ));
        for (kind, failure) in &load.failures {
            text.push_str(&format!(
                "  load error {kind}: {} (first: {})\n",
                failure.count, failure.first_message
            ));
        }
    }
    match report.settle {
        Settle::NotNeeded => {}
        Settle::Waited(Some(waited)) => text.push_str(&format!(
            "settle       every member applied the load phase {} ms after it ended\n",
            waited.as_millis()
        )),
        Settle::Waited(None) => text.push_str(&format!(
            "settle       some member had not applied the load phase {} s after it ended; \
             its stale reads count as errors\n",
            SETTLE_TIMEOUT.as_secs()
        )),
    }
    text.push_str(&format!(
        "requests     {} ({} succeeded, {} errors)\n",
        measured.requests,
        measured.succeeded,
        measured.errors()
    ));
    for (kind, failure) in &measured.failures {
        text.push_str(&format!(
            "  error {kind}: {} (first: {})\n",
            failure.count, failure.first_message
        ));
    }
    text.push_str(&format!(
        "elapsed      {:.3} s\n",
        measured.elapsed.as_secs_f64()
    ));
    text.push_str(&format!(
        "requests/s   {:.1} (successful requests over wall time)\n",
        measured.requests_per_second()
    ));
    text.push_str(&format!(
        "latency      p50 {} us, p90 {} us, p99 {} us, p99.9 {} us, max {} us (mean {:.0} us)\n",
        quantile_us(histogram, 0.5),
        quantile_us(histogram, 0.9),
        quantile_us(histogram, 0.99),
        quantile_us(histogram, 0.999),
        histogram.max(),
        histogram.mean(),
    ));
    if let Some(watch) = &report.watch {
        let delivery = &watch.delivery_us;
        text.push_str(&format!(
            "watchers     {} of single keys, {} of the prefix: {} events during the measured phase; \
             from put sent to event received p50 {} us, p99 {} us, max {} us\n",
            watch.key_watchers,
            watch.prefix_watchers,
            watch.events,
            quantile_us(delivery, 0.5),
            quantile_us(delivery, 0.99),
            delivery.max(),
        ));
    }
    text
}

/// The one machine-readable line: `RESULT ` and space-separated `key=value`
/// pairs without spaces in them.
pub fn result_line(report: &BenchReport) -> String {
    let plan = &report.plan;
    let measured = &report.measured;
    let histogram = &measured.latency_us;
    let (load_requests, load_errors) = report
        .load
        .as_ref()
        .map_or((0, 0), |load| (load.requests, load.errors()));
    let watch = report.watch.as_ref();
    let delivery = watch.map(|w| &w.delivery_us);
    format!(
        "RESULT workload={} requests={} succeeded={} errors={} error_kinds={} elapsed_s={:.3} \
         requests_per_s={:.1} p50_us={} p90_us={} p99_us={} p999_us={} max_us={} mean_us={:.0} \
         connections={} clients={} endpoints={} key_space={} key_bytes={} value_bytes={} \
         warmup_requests={} load_requests={} load_errors={} settle_ms={} seed={} \
         watchers={} prefix_watchers={} watch_events={} watch_p50_us={} watch_p99_us={} \
         watch_max_us={}",
        plan.workload.name(),
        measured.requests,
        measured.succeeded,
        measured.errors(),
        failure_list(&measured.failures),
        measured.elapsed.as_secs_f64(),
        measured.requests_per_second(),
        quantile_us(histogram, 0.5),
        quantile_us(histogram, 0.9),
        quantile_us(histogram, 0.99),
        quantile_us(histogram, 0.999),
        histogram.max(),
        histogram.mean(),
        plan.connections,
        plan.clients,
        plan.endpoints.len(),
        plan.key_space,
        plan.key_bytes,
        plan.value_bytes,
        plan.warmup_requests,
        load_requests,
        load_errors,
        report.settle,
        plan.seed,
        plan.watchers,
        plan.prefix_watchers,
        watch.map_or(0, |w| w.events),
        delivery.map_or(0, |d| quantile_us(d, 0.5)),
        delivery.map_or(0, |d| quantile_us(d, 0.99)),
        delivery.map_or(0, |d| d.max()),
    )
}

/// Runs `ferry bench`. Exits 0 when the run completed (failed requests are
/// reported, not fatal), 2 on bad arguments, 1 when it could not run.
pub fn run(args: BenchArgs) -> ExitCode {
    let plan = match plan(&args) {
        Ok(plan) => plan,
        Err(error) => {
            eprintln!("ferry bench: {error}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("ferry bench: {}", BenchError::Runtime(error));
            return ExitCode::FAILURE;
        }
    };
    let progress = if std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(Some(plan.measured_requests()), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    if let Ok(style) = ProgressStyle::with_template("{bar:40} {pos}/{len} requests {per_sec}") {
        progress.set_style(style);
    }
    let outcome = runtime.block_on(run_bench(&plan, &progress));
    progress.finish_and_clear();
    match outcome {
        Ok(report) => {
            print!("{}", human_summary(&report));
            println!("{}", result_line(&report));
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("ferry bench: {error}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use ferry_server::api::{spawn_server, ApiOptions, EtcdApi};
    use ferry_server::backend::LocalBackend;
    use ferry_server::kv_state::KvLimits;
    use ferry_server::watch::WatchLimits;
    use tokio::sync::oneshot;

    /// `ferry bench`'s arguments alone, to parse them as the binary does.
    #[derive(Parser, Debug)]
    struct BenchCli {
        #[command(flatten)]
        args: BenchArgs,
    }

    /// Two gRPC servers over one in-process store, so that a run spreads
    /// over two endpoints and still sees one key space.
    struct TestCluster {
        endpoints: Vec<String>,
        stops: Vec<oneshot::Sender<()>>,
        tasks: Vec<tokio::task::JoinHandle<()>>,
    }

    impl TestCluster {
        async fn start(servers: usize) -> TestCluster {
            let backend = Arc::new(LocalBackend::new(
                KvLimits::default(),
                WatchLimits::default(),
                "http://127.0.0.1:0".to_string(),
            ));
            let api = EtcdApi::new(backend, ApiOptions::default());
            let mut cluster = TestCluster {
                endpoints: Vec::new(),
                stops: Vec::new(),
                tasks: Vec::new(),
            };
            for _ in 0..servers {
                let (stop, stopped) = oneshot::channel::<()>();
                let (address, task) =
                    spawn_server(api.clone(), "127.0.0.1:0".parse().unwrap(), async {
                        let _ = stopped.await;
                    })
                    .await
                    .unwrap();
                cluster.endpoints.push(address.to_string());
                cluster.stops.push(stop);
                cluster.tasks.push(task);
            }
            cluster
        }

        fn args(&self, workload: Workload) -> BenchArgs {
            BenchArgs {
                endpoints: self.endpoints.join(","),
                connections: 4,
                clients: 8,
                requests: 200,
                workload,
                key_space: 50,
                key_bytes: 10,
                value_bytes: 64,
                warmup_requests: 0,
                seed: 7,
                timeout_ms: 10_000,
                watchers: 0,
                prefix_watchers: 0,
            }
        }

        async fn kv(&self) -> KvClient<GrpcChannel> {
            let channel = Endpoint::from_shared(format!("http://{}", self.endpoints[0]))
                .unwrap()
                .connect()
                .await
                .unwrap();
            KvClient::new(GrpcChannel::new(channel))
        }

        /// Stops every server and waits until they are gone.
        async fn stop(self) {
            for stop in self.stops {
                let _ = stop.send(());
            }
            for task in self.tasks {
                let _ = task.await;
            }
        }
    }

    /// Every key of the key space, read back in one range: (store revision,
    /// key-value pairs).
    async fn read_all(kv: &mut KvClient<GrpcChannel>) -> (i64, Vec<(Vec<u8>, Vec<u8>)>) {
        let response = kv
            .range(RangeRequest {
                key: b"k".to_vec(),
                range_end: b"l".to_vec(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let revision = response.header.unwrap().revision;
        let pairs = response
            .kvs
            .into_iter()
            .map(|kv| (kv.key.to_vec(), kv.value.to_vec()))
            .collect();
        (revision, pairs)
    }

    fn plan_error(edit: impl FnOnce(&mut BenchArgs)) -> String {
        let mut args = BenchArgs::default();
        edit(&mut args);
        match plan(&args) {
            Ok(plan) => panic!("expected the arguments to be refused, got {plan:?}"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn command_line_defaults_match_default_and_plan() {
        let parsed = BenchCli::try_parse_from(["bench"]).unwrap().args;
        let default = BenchArgs::default();
        assert_eq!(format!("{parsed:?}"), format!("{default:?}"));
        let plan = plan(&parsed).unwrap();
        assert_eq!(
            plan.endpoints,
            [
                "http://127.0.0.1:2379",
                "http://127.0.0.1:22379",
                "http://127.0.0.1:32379"
            ]
        );
        let parsed = BenchCli::try_parse_from([
            "bench",
            "--workload",
            "range-serializable",
            "--endpoints",
            "http://a:1, b:2",
            "--clients",
            "3",
            "--connections",
            "2",
        ])
        .unwrap()
        .args;
        let plan = super::plan(&parsed).unwrap();
        assert_eq!(plan.workload, Workload::RangeSerializable);
        assert_eq!(plan.endpoints, ["http://a:1", "http://b:2"]);
        assert!(BenchCli::try_parse_from(["bench", "--workload", "delete"]).is_err());
    }

    #[test]
    fn bad_arguments_are_refused_with_a_reason() {
        let zero_clients = plan_error(|a| a.clients = 0);
        assert!(zero_clients.contains("--clients is 0"), "{zero_clients}");
        let zero_connections = plan_error(|a| a.connections = 0);
        assert!(
            zero_connections.contains("--connections is 0"),
            "{zero_connections}"
        );
        let idle = plan_error(|a| {
            a.connections = 5;
            a.clients = 4
        });
        assert!(
            idle.contains("--connections 5 is more than --clients 4"),
            "{idle}"
        );
        let zero_requests = plan_error(|a| a.requests = 0);
        assert!(zero_requests.contains("--requests is 0"), "{zero_requests}");
        let zero_keys = plan_error(|a| a.key_space = 0);
        assert!(zero_keys.contains("--key-space is 0"), "{zero_keys}");
        let short_keys = plan_error(|a| {
            a.key_space = 1001;
            a.key_bytes = 4
        });
        assert!(
            short_keys.contains("--key-bytes must be at least 5"),
            "{short_keys}"
        );
        let big_value = plan_error(|a| a.value_bytes = VALUE_BYTES_MAX + 1);
        assert!(
            big_value.contains("--value-bytes 1048577 is above the limit"),
            "{big_value}"
        );
        let many_clients = plan_error(|a| a.clients = CLIENTS_MAX + 1);
        assert!(many_clients.contains("--clients"), "{many_clients}");
        let no_endpoints = plan_error(|a| a.endpoints = " , ".to_string());
        assert!(
            no_endpoints.contains("--endpoints is empty"),
            "{no_endpoints}"
        );
        for (endpoint, reason) in [
            ("127.0.0.1", "no :port"),
            ("127.0.0.1:0", "port"),
            ("127.0.0.1:99999", "port"),
            (":2379", "no host"),
            ("https://127.0.0.1:2379", "TLS"),
            ("http://a/b:1", "path"),
        ] {
            let error = plan_error(|a| a.endpoints = format!("127.0.0.1:2379,{endpoint}"));
            assert!(
                error.contains(endpoint) && error.contains(reason),
                "{endpoint}: {error}"
            );
        }
        // The smallest key size that fits is accepted.
        let mut args = BenchArgs {
            key_space: 1000,
            key_bytes: 4,
            ..BenchArgs::default()
        };
        assert!(plan(&args).is_ok());
        args.key_space = 1;
        args.key_bytes = 2;
        assert!(plan(&args).is_ok());
    }

    #[test]
    fn keys_and_values_have_the_asked_size_and_differ() {
        assert_eq!(key_for(42, 8), b"k0000042");
        assert_eq!(key_for(0, 2), b"k0");
        assert_eq!(value_for(42, 8), b"42.vvvvv");
        assert_eq!(value_for(42, 2), b"42");
        assert!(value_for(42, 0).is_empty());
        let values: std::collections::BTreeSet<Vec<u8>> =
            (0..1000).map(|i| value_for(i, 16)).collect();
        assert_eq!(values.len(), 1000);
    }

    #[test]
    fn a_read_is_checked_against_the_loaded_value() {
        use ferry_server::pb::mvccpb::KeyValue;
        let kv = |key: &[u8], value: &[u8]| KeyValue {
            key: bytes::Bytes::copy_from_slice(key),
            value: bytes::Bytes::copy_from_slice(value),
            ..Default::default()
        };
        let response = |kvs: Vec<KeyValue>| RangeResponse {
            count: kvs.len() as i64,
            kvs,
            ..Default::default()
        };
        assert_eq!(
            check_read(&response(vec![kv(b"k1", b"1.v")]), b"k1", b"1.v"),
            Ok(())
        );
        let kind = |r: Result<(), (FailureKind, String)>| r.unwrap_err().0;
        assert_eq!(
            kind(check_read(&response(vec![]), b"k1", b"1.v")),
            FailureKind::MissingKey
        );
        assert_eq!(
            kind(check_read(
                &response(vec![kv(b"k1", b"2.v")]),
                b"k1",
                b"1.v"
            )),
            FailureKind::WrongValue
        );
        assert_eq!(
            kind(check_read(
                &response(vec![kv(b"k2", b"1.v")]),
                b"k1",
                b"1.v"
            )),
            FailureKind::UnexpectedKeys
        );
        assert_eq!(
            kind(check_read(
                &response(vec![kv(b"k1", b"1.v"), kv(b"k1", b"1.v")]),
                b"k1",
                b"1.v"
            )),
            FailureKind::UnexpectedKeys
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn put_workload_sends_exactly_the_requests_asked_for() {
        let cluster = TestCluster::start(2).await;
        let args = BenchArgs {
            warmup_requests: 20,
            ..cluster.args(Workload::Put)
        };
        let plan = plan(&args).unwrap();
        let report = run_bench(&plan, &ProgressBar::hidden()).await.unwrap();
        assert!(report.load.is_none());
        assert_eq!(report.settle, Settle::NotNeeded);
        let measured = &report.measured;
        assert_eq!(measured.requests, 200);
        assert_eq!(measured.succeeded, 200);
        assert_eq!(measured.errors(), 0, "{:?}", measured.failures);
        assert_eq!(measured.latency_us.len(), 200);
        assert!(measured.latency_us.min() >= 1);
        assert!(measured.requests_per_second() > 0.0);

        // The store saw the warm-up and the measured puts and nothing else:
        // every put adds one revision to the first one (1).
        let mut kv = cluster.kv().await;
        let (revision, pairs) = read_all(&mut kv).await;
        assert_eq!(revision, 1 + 20 + 200);
        // The last put's answer carried the last revision.
        assert_eq!(measured.revision_max, revision);
        assert!(!pairs.is_empty() && pairs.len() <= 50);
        for (key, value) in &pairs {
            let index: u64 = std::str::from_utf8(&key[1..]).unwrap().parse().unwrap();
            assert!(index < 50);
            assert_eq!(key.len(), 10);
            assert_eq!(value, &value_for(index, 64));
        }

        let line = result_line(&report);
        assert!(line.starts_with("RESULT "), "{line}");
        for pair in line["RESULT ".len()..].split(' ') {
            let (key, value) = pair.split_once('=').unwrap();
            assert!(!key.is_empty() && !value.is_empty(), "{pair}");
        }
        for expected in [
            "workload=put",
            "requests=200",
            "succeeded=200",
            "errors=0",
            "error_kinds=none",
            "clients=8",
            "connections=4",
            "endpoints=2",
        ] {
            assert!(
                line.contains(&format!(" {expected} ")),
                "{expected}: {line}"
            );
        }
        let summary = human_summary(&report);
        assert!(
            summary.contains("requests     200 (200 succeeded, 0 errors)"),
            "{summary}"
        );
        cluster.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fill_puts_every_key_once_and_nothing_else() {
        let cluster = TestCluster::start(2).await;
        let args = BenchArgs {
            // Neither applies to a fill.
            requests: 7,
            warmup_requests: 20,
            ..cluster.args(Workload::Fill)
        };
        let plan = plan(&args).unwrap();
        let report = run_bench(&plan, &ProgressBar::hidden()).await.unwrap();
        assert!(report.load.is_none());
        let measured = &report.measured;
        assert_eq!(measured.requests, 50);
        assert_eq!(measured.succeeded, 50);
        assert_eq!(measured.errors(), 0, "{:?}", measured.failures);

        let mut kv = cluster.kv().await;
        let (revision, pairs) = read_all(&mut kv).await;
        assert_eq!(revision, 1 + 50);
        assert_eq!(pairs.len(), 50);
        for (index, (key, value)) in pairs.iter().enumerate() {
            assert_eq!(key, &key_for(index as u64, 10));
            assert_eq!(value, &value_for(index as u64, 64));
        }
        assert!(result_line(&report).contains(" workload=fill "));
        cluster.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn range_workloads_read_what_the_load_phase_wrote() {
        for workload in [Workload::RangeLinearizable, Workload::RangeSerializable] {
            let cluster = TestCluster::start(2).await;
            let args = BenchArgs {
                requests: 300,
                warmup_requests: 10,
                ..cluster.args(workload)
            };
            let plan = plan(&args).unwrap();
            let report = run_bench(&plan, &ProgressBar::hidden()).await.unwrap();
            let load = report.load.as_ref().unwrap();
            assert_eq!(load.requests, 50);
            assert_eq!(load.succeeded, 50);
            assert_eq!(load.errors(), 0, "{:?}", load.failures);
            assert_eq!(load.revision_max, 1 + 50);
            match workload {
                Workload::RangeSerializable => {
                    assert!(matches!(report.settle, Settle::Waited(Some(_))))
                }
                _ => assert_eq!(report.settle, Settle::NotNeeded),
            }
            let measured = &report.measured;
            assert_eq!(measured.requests, 300);
            // A success is a read that returned the loaded value.
            assert_eq!(measured.succeeded, 300);
            assert_eq!(measured.errors(), 0, "{:?}", measured.failures);
            assert_eq!(measured.latency_us.len(), 300);

            // The load phase put each key once; the reads wrote nothing.
            let mut kv = cluster.kv().await;
            let (revision, pairs) = read_all(&mut kv).await;
            assert_eq!(revision, 1 + 50);
            let expected: Vec<(Vec<u8>, Vec<u8>)> = (0..50)
                .map(|i| (key_for(i, 10), value_for(i, 64)))
                .collect();
            assert_eq!(pairs, expected);
            let line = result_line(&report);
            assert!(
                line.contains(&format!(" workload={} ", workload.name())),
                "{line}"
            );
            assert!(
                line.contains(" load_requests=50 load_errors=0 settle_ms="),
                "{line}"
            );
            cluster.stop().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_of_changed_or_missing_values_count_as_errors() {
        let cluster = TestCluster::start(1).await;
        let args = BenchArgs {
            connections: 2,
            clients: 4,
            requests: 100,
            key_space: 4,
            ..cluster.args(Workload::RangeLinearizable)
        };
        let plan = plan(&args).unwrap();
        let clients = kv_clients(&connect(&plan).await.unwrap(), plan.clients);
        let quiet = ProgressBar::hidden();
        let load = run_phase(&plan, &clients, PhaseKind::Load, 4, 1, &quiet)
            .await
            .unwrap();
        assert_eq!(load.succeeded, 4);

        // Every key changed behind the benchmark's back: every read fails.
        let mut kv = cluster.kv().await;
        for index in 0..4 {
            kv.put(PutRequest {
                key: key_for(index, 10).into(),
                value: bytes::Bytes::from_static(b"changed"),
                ..Default::default()
            })
            .await
            .unwrap();
        }
        let outcome = run_phase(&plan, &clients, PhaseKind::Workload, 100, 1, &quiet)
            .await
            .unwrap();
        assert_eq!(outcome.requests, 100);
        assert_eq!(outcome.succeeded, 0);
        assert_eq!(outcome.failures.len(), 1, "{:?}", outcome.failures);
        let wrong = &outcome.failures[&FailureKind::WrongValue];
        assert_eq!(wrong.count, 100);
        assert!(
            wrong.first_message.contains("\"changed\""),
            "{}",
            wrong.first_message
        );
        assert!(outcome.latency_us.is_empty());

        // Every key gone: every read fails as missing.
        kv.delete_range(ferry_server::pb::etcdserverpb::DeleteRangeRequest {
            key: b"k".to_vec(),
            range_end: b"l".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap();
        let outcome = run_phase(&plan, &clients, PhaseKind::Workload, 30, 1, &quiet)
            .await
            .unwrap();
        assert_eq!(outcome.failures[&FailureKind::MissingKey].count, 30);
        let report = BenchReport {
            plan: plan.clone(),
            load: Some(load),
            settle: Settle::NotNeeded,
            measured: outcome,
            watch: None,
        };
        let line = result_line(&report);
        assert!(
            line.contains(" errors=30 error_kinds=MissingKey:30 "),
            "{line}"
        );
        assert!(human_summary(&report).contains("error MissingKey: 30 (first: key k"));
        cluster.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn watchers_see_every_measured_put_and_their_delivery_is_timed() {
        let cluster = TestCluster::start(2).await;
        let args = BenchArgs {
            warmup_requests: 20,
            // 150 watchers of single keys over a key space of 100: 50 idle.
            watchers: 150,
            prefix_watchers: 3,
            key_space: 100,
            ..cluster.args(Workload::Put)
        };
        let plan = plan(&args).unwrap();
        let report = run_bench(&plan, &ProgressBar::hidden()).await.unwrap();
        assert_eq!(report.measured.succeeded, 200);
        let watch = report.watch.as_ref().expect("the run had watchers");
        // Each measured put reaches the watcher of its key and the three
        // of the prefix: four events.
        assert_eq!(watch.events, 200 * 4, "{watch:?}");
        assert_eq!(watch.delivery_us.len(), 200 * 4);
        assert!(watch.delivery_us.min() >= 1);
        let line = result_line(&report);
        assert!(
            line.contains(" watchers=150 prefix_watchers=3 watch_events=800 "),
            "{line}"
        );
        assert!(human_summary(&report).contains("150 of single keys, 3 of the prefix: 800 events"));
        cluster.stop().await;
    }

    #[test]
    fn watchers_need_room_in_the_value_for_the_send_time() {
        let error = plan(&BenchArgs {
            watchers: 1,
            value_bytes: 4,
            ..BenchArgs::default()
        })
        .unwrap_err();
        assert!(matches!(
            error,
            BenchError::ValueTooShortForWatchers {
                value_bytes: 4,
                needed: 8
            }
        ));
        assert!(plan(&BenchArgs {
            watchers: WATCHERS_MAX,
            prefix_watchers: 1,
            ..BenchArgs::default()
        })
        .is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_settle_wait_ends_only_at_the_revision_asked_for() {
        let cluster = TestCluster::start(2).await;
        let plan = plan(&cluster.args(Workload::RangeSerializable)).unwrap();
        let channels = connect(&plan).await.unwrap();
        let mut kv = cluster.kv().await;
        let (revision, _) = read_all(&mut kv).await;
        let reached = wait_until_applied(&channels, revision, Duration::from_secs(5)).await;
        assert!(reached.is_some_and(|waited| waited < Duration::from_secs(5)));
        // No member will ever reach a revision nobody wrote.
        let started = Instant::now();
        let never = wait_until_applied(&channels, revision + 1, Duration::from_millis(200)).await;
        assert_eq!(never, None);
        assert!(started.elapsed() >= Duration::from_millis(200));
        let report = BenchReport {
            plan,
            load: None,
            settle: Settle::Waited(never),
            measured: PhaseOutcome {
                requests: 0,
                succeeded: 0,
                failures: BTreeMap::new(),
                latency_us: latency_histogram().unwrap(),
                elapsed: Duration::ZERO,
                revision_max: 0,
            },
            watch: None,
        };
        assert!(result_line(&report).contains(" settle_ms=timeout "));
        assert!(human_summary(&report).contains("had not applied the load phase"));
        cluster.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_to_a_stopped_server_are_counted_not_fatal() {
        let cluster = TestCluster::start(1).await;
        let args = BenchArgs {
            connections: 1,
            clients: 2,
            requests: 20,
            timeout_ms: 2_000,
            ..cluster.args(Workload::Put)
        };
        let plan = plan(&args).unwrap();
        let clients = kv_clients(&connect(&plan).await.unwrap(), plan.clients);
        cluster.stop().await;
        let quiet = ProgressBar::hidden();
        let outcome = run_phase(&plan, &clients, PhaseKind::Workload, 20, 1, &quiet)
            .await
            .unwrap();
        assert_eq!(outcome.requests, 20);
        assert_eq!(outcome.succeeded, 0);
        assert_eq!(outcome.errors(), 20, "{:?}", outcome.failures);
        assert!(outcome.latency_us.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_endpoint_that_does_not_answer_is_a_connect_error() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let args = BenchArgs {
            endpoints: format!("127.0.0.1:{port}"),
            connections: 1,
            clients: 1,
            ..BenchArgs::default()
        };
        let plan = plan(&args).unwrap();
        let error = run_bench(&plan, &ProgressBar::hidden()).await.unwrap_err();
        assert!(matches!(error, BenchError::Connect { .. }), "{error:?}");
        let message = error.to_string();
        assert!(
            message.contains(&format!("cannot connect to http://127.0.0.1:{port}")),
            "{message}"
        );
    }
}
