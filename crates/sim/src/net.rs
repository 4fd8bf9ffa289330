//! The simulated network: per-message delay (with a slow tail, so messages
//! overtake each other), loss, duplication, partitions (symmetric and
//! one-way), links that clog (hold every message) and heal, and a
//! connection-setup window in which a freshly (re)connected link loses what
//! is sent on it, as a real transport does before it is ready.
//!
//! The network decides what happens to a message when it is sent; the
//! simulator schedules the deliveries.

use std::collections::{BTreeMap, BTreeSet};

use ferry_raft::{Message, NodeId};

use crate::rng::SimRng;

/// The most messages a clogged link holds; beyond that it drops (and
/// counts) them, as a full socket buffer would.
pub const CLOGGED_MESSAGES_MAX: usize = 4096;

/// The network's parameters for one run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// The least one-way delay.
    pub delay_min_us: u64,
    /// The usual greatest one-way delay.
    pub delay_max_us: u64,
    /// Chance of a much slower delivery (up to `slow_factor` times the max).
    pub slow_ppm: u32,
    /// How much slower a slow delivery may be.
    pub slow_factor: u64,
    /// Chance a message is lost.
    pub loss_ppm: u32,
    /// Chance a message is delivered twice.
    pub duplicate_ppm: u32,
}

impl NetConfig {
    /// A reliable network with fixed small delays (for scenarios).
    pub fn reliable() -> Self {
        NetConfig {
            delay_min_us: 200,
            delay_max_us: 400,
            slow_ppm: 0,
            slow_factor: 1,
            loss_ppm: 0,
            duplicate_ppm: 0,
        }
    }

    /// Parameters drawn from the run's generator.
    pub fn random(rng: &mut SimRng) -> Self {
        let delay_min_us = rng.range(50, 500);
        NetConfig {
            delay_min_us,
            delay_max_us: delay_min_us + rng.range(100, 3_000),
            slow_ppm: rng.range(0, 50_000) as u32,
            slow_factor: rng.range(2, 20),
            loss_ppm: rng.range(0, 150_000) as u32,
            duplicate_ppm: rng.range(0, 100_000) as u32,
        }
    }
}

/// Why a message was not delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// Lost at random.
    Loss,
    /// A partition separates sender and receiver.
    Partition,
    /// The link was still being set up.
    ConnectWindow,
    /// The link is clogged and its buffer is full.
    ClogOverflow,
}

/// What the network did with a sent message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendOutcome {
    /// Deliver after each of these delays (two when duplicated).
    Deliver(Vec<u64>),
    /// Held by a clogged link until it heals.
    Held,
    /// Dropped.
    Dropped(DropReason),
}

/// A partition: which directed links carry nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Partition {
    /// Directed links (from, to) that drop everything.
    pub blocked: BTreeSet<(NodeId, NodeId)>,
}

impl Partition {
    /// Splits `nodes` into `side` and the rest, both ways.
    pub fn halves(nodes: &[NodeId], side: &BTreeSet<NodeId>) -> Self {
        let mut blocked = BTreeSet::new();
        for &a in nodes {
            for &b in nodes {
                if a != b && side.contains(&a) != side.contains(&b) {
                    blocked.insert((a, b));
                }
            }
        }
        Partition { blocked }
    }

    /// Cuts `node` off from everyone, both ways.
    pub fn isolate(nodes: &[NodeId], node: NodeId) -> Self {
        Partition::halves(nodes, &BTreeSet::from([node]))
    }

    /// Blocks only the given directed links.
    pub fn one_way(links: impl IntoIterator<Item = (NodeId, NodeId)>) -> Self {
        Partition {
            blocked: links.into_iter().collect(),
        }
    }

    /// Whether a and b are cut apart in both directions (the transport
    /// notices: the connection breaks).
    pub fn disconnects(&self, a: NodeId, b: NodeId) -> bool {
        self.blocked.contains(&(a, b)) && self.blocked.contains(&(b, a))
    }
}

/// The simulated network between all nodes of a run.
#[derive(Clone, Debug)]
pub struct Network {
    config: NetConfig,
    partition: Partition,
    clogged: BTreeMap<(NodeId, NodeId), Vec<Message>>,
    /// Per unordered pair (low id first): until when the link is still being set up.
    setup_until_us: BTreeMap<(NodeId, NodeId), u64>,
}

/// Unordered node pairs (low id first) whose connection changed.
pub type PairList = Vec<(NodeId, NodeId)>;

fn pair(a: NodeId, b: NodeId) -> (NodeId, NodeId) {
    (a.min(b), a.max(b))
}

impl Network {
    /// A network with no partition and no clogs.
    pub fn new(config: NetConfig) -> Self {
        Network {
            config,
            partition: Partition::default(),
            clogged: BTreeMap::new(),
            setup_until_us: BTreeMap::new(),
        }
    }

    /// The run's parameters.
    pub fn config(&self) -> &NetConfig {
        &self.config
    }

    /// Replaces the parameters (the liveness phase turns loss off).
    pub fn set_config(&mut self, config: NetConfig) {
        self.config = config;
    }

    /// The partition in force.
    pub fn partition(&self) -> &Partition {
        &self.partition
    }

    /// Installs a partition (replacing any other). Returns the unordered
    /// pairs whose connection broke and those whose connection came back.
    pub fn set_partition(&mut self, next: Partition, nodes: &[NodeId]) -> (PairList, PairList) {
        let mut broke = Vec::new();
        let mut restored = Vec::new();
        for (i, &a) in nodes.iter().enumerate() {
            for &b in &nodes[i + 1..] {
                let was = self.partition.disconnects(a, b);
                let will = next.disconnects(a, b);
                if !was && will {
                    broke.push(pair(a, b));
                } else if was && !will {
                    restored.push(pair(a, b));
                }
            }
        }
        self.partition = next;
        (broke, restored)
    }

    /// Whether the transport between a and b is connected (no symmetric cut).
    pub fn connected(&self, a: NodeId, b: NodeId) -> bool {
        !self.partition.disconnects(a, b)
    }

    /// The link between a and b (re)connects now and is ready at `ready_at_us`;
    /// until then what is sent on it is lost.
    pub fn start_setup(&mut self, a: NodeId, b: NodeId, ready_at_us: u64) {
        self.setup_until_us.insert(pair(a, b), ready_at_us);
    }

    /// Starts holding every message on the directed link.
    pub fn clog(&mut self, from: NodeId, to: NodeId) {
        self.clogged.entry((from, to)).or_default();
    }

    /// Whether the directed link is clogged.
    pub fn is_clogged(&self, from: NodeId, to: NodeId) -> bool {
        self.clogged.contains_key(&(from, to))
    }

    /// The clogged links.
    pub fn clogged_links(&self) -> Vec<(NodeId, NodeId)> {
        self.clogged.keys().copied().collect()
    }

    /// Heals a clogged link; returns what it held, in order.
    pub fn unclog(&mut self, from: NodeId, to: NodeId) -> Vec<Message> {
        self.clogged.remove(&(from, to)).unwrap_or_default()
    }

    /// Decides the fate of a message sent now.
    pub fn send(&mut self, now_us: u64, message: &Message, rng: &mut SimRng) -> SendOutcome {
        let (from, to) = (message.from, message.to);
        if self.partition.blocked.contains(&(from, to)) {
            return SendOutcome::Dropped(DropReason::Partition);
        }
        if self
            .setup_until_us
            .get(&pair(from, to))
            .is_some_and(|until| now_us < *until)
        {
            return SendOutcome::Dropped(DropReason::ConnectWindow);
        }
        if let Some(held) = self.clogged.get_mut(&(from, to)) {
            if held.len() >= CLOGGED_MESSAGES_MAX {
                return SendOutcome::Dropped(DropReason::ClogOverflow);
            }
            held.push(message.clone());
            return SendOutcome::Held;
        }
        if rng.chance_ppm(self.config.loss_ppm) {
            return SendOutcome::Dropped(DropReason::Loss);
        }
        let copies = if rng.chance_ppm(self.config.duplicate_ppm) {
            2
        } else {
            1
        };
        SendOutcome::Deliver((0..copies).map(|_| self.delay_us(rng)).collect())
    }

    /// A delay drawn from the run's distribution.
    pub fn delay_us(&self, rng: &mut SimRng) -> u64 {
        let c = &self.config;
        let delay = rng.range_inclusive(c.delay_min_us, c.delay_max_us);
        if rng.chance_ppm(c.slow_ppm) {
            delay.saturating_mul(rng.range_inclusive(1, c.slow_factor.max(1)))
        } else {
            delay
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_raft::MessageBody;

    fn message(from: NodeId, to: NodeId) -> Message {
        Message {
            group: 1,
            from,
            to,
            term: 1,
            body: MessageBody::TimeoutNow,
        }
    }

    #[test]
    fn reliable_network_delivers_once_within_bounds() {
        let mut net = Network::new(NetConfig::reliable());
        let mut rng = SimRng::new(1);
        for _ in 0..100 {
            match net.send(0, &message(1, 2), &mut rng) {
                SendOutcome::Deliver(delays) => {
                    assert_eq!(delays.len(), 1);
                    assert!((200..=400).contains(&delays[0]));
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn loss_and_duplication_happen_at_their_rates() {
        let config = NetConfig {
            loss_ppm: 200_000,
            duplicate_ppm: 500_000,
            ..NetConfig::reliable()
        };
        let mut net = Network::new(config);
        let mut rng = SimRng::new(2);
        let (mut lost, mut doubled) = (0, 0);
        for _ in 0..10_000 {
            match net.send(0, &message(1, 2), &mut rng) {
                SendOutcome::Dropped(DropReason::Loss) => lost += 1,
                SendOutcome::Deliver(d) if d.len() == 2 => doubled += 1,
                SendOutcome::Deliver(_) => {}
                other => panic!("{other:?}"),
            }
        }
        assert!((1_700..2_300).contains(&lost), "{lost}");
        assert!((3_600..4_400).contains(&doubled), "{doubled}");
    }

    #[test]
    fn partitions_block_and_report_connection_changes() {
        let nodes = [1, 2, 3];
        let mut net = Network::new(NetConfig::reliable());
        let mut rng = SimRng::new(3);
        let (broke, restored) = net.set_partition(Partition::isolate(&nodes, 3), &nodes);
        assert_eq!(broke, vec![(1, 3), (2, 3)]);
        assert!(restored.is_empty());
        assert_eq!(
            net.send(0, &message(3, 1), &mut rng),
            SendOutcome::Dropped(DropReason::Partition)
        );
        assert!(matches!(
            net.send(0, &message(1, 2), &mut rng),
            SendOutcome::Deliver(_)
        ));
        assert!(!net.connected(1, 3));
        // A one-way cut drops one direction but keeps the connection.
        let (broke, restored) = net.set_partition(Partition::one_way([(1, 2)]), &nodes);
        assert!(broke.is_empty());
        assert_eq!(restored, vec![(1, 3), (2, 3)]);
        assert!(net.connected(1, 2));
        assert_eq!(
            net.send(0, &message(1, 2), &mut rng),
            SendOutcome::Dropped(DropReason::Partition)
        );
        assert!(matches!(
            net.send(0, &message(2, 1), &mut rng),
            SendOutcome::Deliver(_)
        ));
    }

    #[test]
    fn setup_window_loses_messages_until_ready() {
        let mut net = Network::new(NetConfig::reliable());
        let mut rng = SimRng::new(4);
        net.start_setup(2, 1, 1_000);
        assert_eq!(
            net.send(999, &message(1, 2), &mut rng),
            SendOutcome::Dropped(DropReason::ConnectWindow)
        );
        assert!(matches!(
            net.send(1_000, &message(1, 2), &mut rng),
            SendOutcome::Deliver(_)
        ));
    }

    #[test]
    fn clogged_links_hold_in_order_and_release() {
        let mut net = Network::new(NetConfig::reliable());
        let mut rng = SimRng::new(5);
        net.clog(1, 2);
        let mut first = message(1, 2);
        first.term = 7;
        assert_eq!(net.send(0, &first, &mut rng), SendOutcome::Held);
        assert_eq!(net.send(1, &message(1, 2), &mut rng), SendOutcome::Held);
        assert!(matches!(
            net.send(1, &message(2, 1), &mut rng),
            SendOutcome::Deliver(_)
        ));
        let held = net.unclog(1, 2);
        assert_eq!(held.len(), 2);
        assert_eq!(held[0].term, 7);
        assert!(!net.is_clogged(1, 2));
        for _ in 0..CLOGGED_MESSAGES_MAX {
            net.clog(3, 4);
            net.send(0, &message(3, 4), &mut rng);
        }
        assert_eq!(
            net.send(0, &message(3, 4), &mut rng),
            SendOutcome::Dropped(DropReason::ClogOverflow)
        );
    }
}
