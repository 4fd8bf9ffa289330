//! Watchers for `ferry bench --watchers N --prefix-watchers M`: what a put
//! costs while a member also serves watchers, and how soon they see it.
//!
//! Watcher `i` of the first kind watches the single key `i` of the
//! benchmark's key space (keys past the key space get no events, so 10,000
//! watchers over 1,000 keys are 1,000 busy ones and 9,000 idle ones, which
//! a member must not pay for on every put); the second kind watch the
//! prefix `k` that every benchmark key has, so each sees every put. They
//! are spread over watch streams of at most [`WATCHERS_PER_STREAM`], the
//! streams round-robin over the benchmark's connections.
//!
//! Delivery latency: while watchers run, each measured put carries the
//! time it was sent in the first 8 bytes of its value (nanoseconds on this
//! process's monotonic clock), and a watch stream that receives the event
//! records how long after that it arrived. Every event of the measured
//! phase counts, those of every watcher.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ferry_server::grpc_client::GrpcChannel;
use ferry_server::pb::etcdserverpb::watch_client::WatchClient;
use ferry_server::pb::etcdserverpb::watch_request::RequestUnion;
use ferry_server::pb::etcdserverpb::{WatchCreateRequest, WatchRequest};
use hdrhistogram::Histogram;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;

use crate::bench_cmd::{key_for, latency_histogram, BenchError, BenchPlan};

/// Watchers one watch stream carries (below ferry's per-stream limit of
/// 4096 and etcd's absence of one).
pub const WATCHERS_PER_STREAM: u64 = 1000;
/// Watchers one run may open, of both kinds together.
pub const WATCHERS_MAX: u64 = 100_000;
/// Bytes of a value that carry its send time.
pub const STAMP_BYTES: usize = 8;
/// How long the watchers may take to be created before the run gives up.
const CREATE_TIMEOUT: Duration = Duration::from_secs(60);

/// The instant send times are counted from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Writes the time now into the first [`STAMP_BYTES`] of `value`.
pub fn stamp(value: &mut [u8]) {
    let nanos = now_nanos();
    if let Some(head) = value.get_mut(..STAMP_BYTES) {
        head.copy_from_slice(&nanos.to_le_bytes());
    }
}

/// When the value was stamped and how long ago, if it carries a stamp.
fn stamp_of(value: &[u8]) -> Option<(u64, Duration)> {
    let head: [u8; STAMP_BYTES] = value.get(..STAMP_BYTES)?.try_into().ok()?;
    let sent_nanos = u64::from_le_bytes(head);
    let late = epoch()
        .elapsed()
        .checked_sub(Duration::from_nanos(sent_nanos))?;
    Some((sent_nanos, late))
}

/// Nanoseconds since the epoch now.
fn now_nanos() -> u64 {
    u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// What the watchers saw during the measured phase.
#[derive(Debug, Clone)]
pub struct WatchOutcome {
    /// Watchers of single keys.
    pub key_watchers: u64,
    /// Watchers of the prefix every key has.
    pub prefix_watchers: u64,
    /// Events of the measured phase's puts received, all watchers together.
    pub events: u64,
    /// Time from a put's send to each of its events' arrival, microseconds.
    pub delivery_us: Histogram<u64>,
}

/// The running watch streams.
pub struct Watchers {
    key_watchers: u64,
    prefix_watchers: u64,
    measuring: Arc<AtomicBool>,
    /// Puts sent from this time on (nanoseconds since the epoch) count:
    /// the warm-up's events may arrive after the measured phase began.
    measured_from: Arc<AtomicU64>,
    events: Arc<AtomicU64>,
    delivery_us: Arc<Mutex<Histogram<u64>>>,
    /// Kept so that the streams stay open; dropped at the end.
    _senders: Vec<tokio::sync::mpsc::Sender<WatchRequest>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Watchers {
    /// Opens the plan's watchers and waits until every one is created.
    pub async fn start(plan: &BenchPlan, channels: &[GrpcChannel]) -> Result<Watchers, BenchError> {
        let total = plan.watchers + plan.prefix_watchers;
        let measuring = Arc::new(AtomicBool::new(false));
        let measured_from = Arc::new(AtomicU64::new(u64::MAX));
        let events = Arc::new(AtomicU64::new(0));
        let delivery_us = Arc::new(Mutex::new(latency_histogram()?));
        let created = Arc::new(AtomicU64::new(0));
        let mut senders = Vec::new();
        let mut tasks = Vec::new();
        let streams = total.div_ceil(WATCHERS_PER_STREAM);
        for stream in 0..streams {
            let first = stream * WATCHERS_PER_STREAM;
            let last = (first + WATCHERS_PER_STREAM).min(total);
            let channel = channels[(stream as usize) % channels.len()].clone();
            // Room for every create request of the stream: they are queued
            // before the call, since a server may send the response headers
            // only with its first answer.
            let (sender, receiver) = tokio::sync::mpsc::channel(WATCHERS_PER_STREAM as usize);
            for watcher in first..last {
                let (key, range_end) = if watcher < plan.watchers {
                    (key_for(watcher, plan.key_bytes), Vec::new())
                } else {
                    (b"k".to_vec(), b"l".to_vec())
                };
                let request = WatchRequest {
                    request_union: Some(RequestUnion::CreateRequest(WatchCreateRequest {
                        key,
                        range_end,
                        ..Default::default()
                    })),
                };
                sender
                    .try_send(request)
                    .map_err(|error| BenchError::Watch(error.to_string()))?;
            }
            let mut client = WatchClient::new(channel).max_decoding_message_size(64 << 20);
            let response = client
                .watch(ReceiverStream::new(receiver))
                .await
                .map_err(|status| BenchError::Watch(status.to_string()))?;
            senders.push(sender);
            let mut inbound = response.into_inner();
            let measured_from = measured_from.clone();
            let (measuring, events, delivery_us, created) = (
                measuring.clone(),
                events.clone(),
                delivery_us.clone(),
                created.clone(),
            );
            tasks.push(tokio::spawn(async move {
                while let Ok(Some(message)) = inbound.message().await {
                    if message.created {
                        created.fetch_add(1, Ordering::Relaxed);
                    }
                    if !measuring.load(Ordering::Relaxed) || message.events.is_empty() {
                        continue;
                    }
                    let mut histogram = delivery_us
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                    let from = measured_from.load(Ordering::Relaxed);
                    for event in &message.events {
                        let stamp = event.kv.as_ref().and_then(|kv| stamp_of(&kv.value));
                        if let Some((_, late)) = stamp.filter(|(sent, _)| *sent >= from) {
                            let micros = u64::try_from(late.as_micros()).unwrap_or(u64::MAX);
                            histogram.saturating_record(micros.max(1));
                            events.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        let deadline = Instant::now() + CREATE_TIMEOUT;
        while created.load(Ordering::Relaxed) < total {
            if Instant::now() >= deadline {
                return Err(BenchError::Watch(format!(
                    "{} of {total} watchers created within {} s",
                    created.load(Ordering::Relaxed),
                    CREATE_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(Watchers {
            key_watchers: plan.watchers,
            prefix_watchers: plan.prefix_watchers,
            measuring,
            measured_from,
            events,
            delivery_us,
            _senders: senders,
            tasks,
        })
    }

    /// Counts events from now on (the measured phase).
    pub fn measure(&self) {
        self.measured_from.store(now_nanos(), Ordering::Relaxed);
        self.measuring.store(true, Ordering::Relaxed);
    }

    /// Waits for the events of the last puts to arrive (until none has
    /// for a while), then closes the streams and reports.
    pub async fn finish(self) -> WatchOutcome {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let seen = self.events.load(Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(300)).await;
            if self.events.load(Ordering::Relaxed) == seen || Instant::now() >= deadline {
                break;
            }
        }
        self.measuring.store(false, Ordering::Relaxed);
        for task in &self.tasks {
            task.abort();
        }
        let delivery_us = self
            .delivery_us
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        WatchOutcome {
            key_watchers: self.key_watchers,
            prefix_watchers: self.prefix_watchers,
            events: self.events.load(Ordering::Relaxed),
            delivery_us,
        }
    }
}
