//! Three node hosts in one process over loopback, running many groups of a
//! small machine: proposals through any member, linearizable queries, a
//! host that stops and the groups it led, a host that restarts from its
//! data directory, and a member that joins late and catches up from a
//! snapshot.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_runtime::{
    ApplyError, BytesSnapshot, Command, GroupError, GroupHandle, HostConfig, Membership, NodeHost,
    ReadConsistency, RestoreError, SnapshotPolicy, SnapshotSource, StateMachine,
};

#[path = "support/ports.rs"]
mod ports;
use ports::free_port;

/// A log of the commands applied, as text: every member must hold the same.
#[derive(Default)]
struct Journal {
    lines: Vec<String>,
    /// While set, every restore fails (as a damaged snapshot would).
    refuse_restores: Option<Arc<AtomicBool>>,
}

impl StateMachine for Journal {
    type Response = usize;
    type Query = ();
    type QueryResponse = Vec<String>;

    fn apply(&mut self, command: Command<'_>) -> Result<usize, ApplyError> {
        self.lines
            .push(String::from_utf8_lossy(command.data).into_owned());
        Ok(self.lines.len())
    }

    fn query(&self, (): ()) -> Vec<String> {
        self.lines.clone()
    }

    fn snapshot(&self) -> Box<dyn SnapshotSource> {
        Box::new(BytesSnapshot(self.lines.join("\n").into_bytes().into()))
    }

    fn restore(&mut self, snapshot: &mut dyn std::io::Read) -> Result<(), RestoreError> {
        let snapshot_bytes = read_snapshot(snapshot)?;
        let snapshot = snapshot_bytes.as_slice();
        if self
            .refuse_restores
            .as_ref()
            .is_some_and(|refuse| refuse.load(Ordering::SeqCst))
        {
            return Err(RestoreError::new("refused by the test"));
        }
        let text = std::str::from_utf8(snapshot).map_err(|e| RestoreError::new(e.to_string()))?;
        self.lines = if text.is_empty() {
            Vec::new()
        } else {
            text.split('\n').map(str::to_owned).collect()
        };
        Ok(())
    }
}

/// The whole of a snapshot handed to `restore` (these machines are small).
fn read_snapshot(snapshot: &mut dyn std::io::Read) -> Result<Vec<u8>, RestoreError> {
    let mut bytes = Vec::new();
    snapshot
        .read_to_end(&mut bytes)
        .map_err(|e| RestoreError::new(e.to_string()))?;
    Ok(bytes)
}

struct Cluster {
    dir: PathBuf,
    ports: BTreeMap<u64, u16>,
    hosts: BTreeMap<u64, NodeHost>,
}

impl Cluster {
    fn new(name: &str, nodes: u64) -> Cluster {
        let dir = std::env::temp_dir().join(format!("ferry-runtime-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Cluster {
            dir,
            ports: (1..=nodes).map(|id| (id, free_port())).collect(),
            hosts: BTreeMap::new(),
        }
    }

    fn config(&self, id: u64) -> HostConfig {
        let mut config = HostConfig::new(
            id,
            self.dir.join(format!("node-{id}")),
            format!("127.0.0.1:{}", self.ports[&id]).parse().unwrap(),
        );
        for (peer, port) in &self.ports {
            if *peer != id {
                config.peers.insert(*peer, format!("127.0.0.1:{port}"));
            }
        }
        config.workers = 2;
        config.tick_interval = Duration::from_millis(20);
        // Small snapshots often, so that the tests see them.
        config.snapshot_policy = SnapshotPolicy {
            log_bytes_min: 2000,
            log_to_snapshot_percent: 100,
            entries_max: None,
        };
        config.engine.compaction_lag_entries = 5;
        config
    }

    async fn start(&mut self, id: u64) -> &NodeHost {
        let host = NodeHost::start(self.config(id)).await.unwrap();
        self.hosts.insert(id, host);
        &self.hosts[&id]
    }

    /// Starts hosts 1 to `hosts` with group 1 of members 1, 2 and 3, a
    /// journal, on each; their handles by host.
    async fn start_journals(&mut self, hosts: u64) -> BTreeMap<u64, GroupHandle<Journal>> {
        let mut handles = BTreeMap::new();
        for id in 1..=hosts {
            let host = self.start(id).await.clone();
            let handle = host
                .start_group(1, Membership::Found(vec![1, 2, 3]), Journal::default())
                .await
                .unwrap();
            handles.insert(id, handle);
        }
        handles
    }

    async fn stop(&mut self, id: u64) {
        if let Some(host) = self.hosts.remove(&id) {
            host.shutdown().await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Proposes `data` through `handle` until it is accepted (no leader yet
/// and forwarding races are retried), within 20 s.
async fn propose(handle: &GroupHandle<Journal>, data: String) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match handle.propose(data.clone().into_bytes()).await {
            Ok(length) => return length,
            Err(error) => {
                assert!(
                    Instant::now() < deadline,
                    "group {}: {data}: {error}",
                    handle.group()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

async fn read(handle: &GroupHandle<Journal>) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match handle.query((), ReadConsistency::Linearizable).await {
            Ok(lines) => return lines,
            Err(error) => {
                assert!(
                    Instant::now() < deadline,
                    "group {}: read: {error}",
                    handle.group()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Waits, 20 s at most, until the machine of `handle` on its own node
/// holds exactly `expected` (a member catching up).
async fn wait_for_lines<M>(handle: &GroupHandle<M>, expected: &[String], what: &str)
where
    M: StateMachine<Query = (), QueryResponse = Vec<String>>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let lines = handle
            .query((), ReadConsistency::Local { min_applied: None })
            .await
            .unwrap();
        if lines == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} holds {} of {} lines",
            lines.len(),
            expected.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn leader_of(handle: &GroupHandle<Journal>) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(status) = handle.status().await {
            if let Some(leader) = status.leader {
                return leader;
            }
        }
        assert!(
            Instant::now() < deadline,
            "group {} elects no leader",
            handle.group()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const GROUPS: u64 = 24;

async fn start_groups(host: &NodeHost, voters: &[u64]) -> BTreeMap<u64, GroupHandle<Journal>> {
    let mut handles = BTreeMap::new();
    for group in 1..=GROUPS {
        let handle = host
            .start_group(
                group,
                Membership::Found(voters.to_vec()),
                Journal::default(),
            )
            .await
            .unwrap();
        handles.insert(group, handle);
    }
    handles
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_groups_replicate_through_any_member_and_survive_a_host_stopping() {
    let mut cluster = Cluster::new("many", 3);
    let mut handles = BTreeMap::new();
    for id in 1..=3 {
        let host = cluster.start(id).await.clone();
        handles.insert(id, start_groups(&host, &[1, 2, 3]).await);
    }
    // Every group takes writes through every member.
    for group in 1..=GROUPS {
        for id in 1..=3u64 {
            propose(&handles[&id][&group], format!("g{group}-n{id}")).await;
        }
    }
    for group in 1..=GROUPS {
        for id in 1..=3u64 {
            let lines = read(&handles[&id][&group]).await;
            assert_eq!(lines.len(), 3, "group {group} on node {id}: {lines:?}");
        }
    }
    // Idle, every group goes quiet on every node.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !handles
        .values()
        .all(|groups| groups.values().all(|handle| handle.view().quiescent))
    {
        assert!(
            Instant::now() < deadline,
            "the idle groups never went quiet"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Stop the host that leads group 1: every group it led elects another
    // leader, and every group goes on through the other two.
    let stopped = leader_of(&handles[&1][&1]).await;
    handles.remove(&stopped);
    cluster.stop(stopped).await;
    let live: Vec<u64> = handles.keys().copied().collect();
    for group in 1..=GROUPS {
        let handle = &handles[&live[0]][&group];
        propose(handle, format!("g{group}-after")).await;
        let lines = read(&handles[&live[1]][&group]).await;
        assert_eq!(lines.len(), 4, "group {group}: {lines:?}");
        assert_eq!(lines[3], format!("g{group}-after"));
        assert_ne!(leader_of(handle).await, stopped);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_restarts_from_its_data_and_a_late_member_catches_up_from_a_snapshot() {
    let mut cluster = Cluster::new("restart", 3);
    let mut handles = BTreeMap::new();
    // Nodes 1 and 2 form the groups; node 3 is a founder that starts late.
    for id in 1..=2 {
        let host = cluster.start(id).await.clone();
        handles.insert(id, start_groups(&host, &[1, 2, 3]).await);
    }
    // Enough writes for several snapshots, and a log compacted behind them.
    let value = "x".repeat(200);
    for group in 1..=4u64 {
        for i in 0..40 {
            propose(&handles[&1][&group], format!("{group}-{i}-{value}")).await;
        }
    }
    let expected: BTreeMap<u64, Vec<String>> = {
        let mut expected = BTreeMap::new();
        for group in 1..=4u64 {
            expected.insert(group, read(&handles[&1][&group]).await);
        }
        expected
    };
    // Node 3 joins late: it is sent a snapshot and the log after it. It
    // takes none of its own, so a snapshot file there was received.
    let mut config = cluster.config(3);
    config.snapshot_policy.log_bytes_min = u64::MAX;
    let host3 = NodeHost::start(config).await.unwrap();
    cluster.hosts.insert(3, host3.clone());
    let late = start_groups(&host3, &[1, 2, 3]).await;
    for group in 1..=4u64 {
        let what = format!("group {group} on the late node");
        wait_for_lines(&late[&group], &expected[&group], &what).await;
    }
    let received: Vec<String> = std::fs::read_dir(cluster.dir.join("node-3/snapshots"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".snap"))
        .collect();
    for group in 1..=4u64 {
        assert!(
            received
                .iter()
                .any(|name| name.starts_with(&format!("g{group:020}-"))),
            "group {group} was caught up without a snapshot: {received:?}"
        );
    }
    // Node 1 restarts from its data directory: every group resumes with
    // its state (snapshot plus log), and takes writes again. (A group with
    // nothing synced yet has nothing to recover: wait until each has made
    // its leader's first entry durable here. Under load some had not, and
    // the test failed now and then.)
    let deadline = Instant::now() + Duration::from_secs(20);
    for handle in handles[&1].values() {
        while handle.view_with(|view| view.durable_index) == 0 {
            assert!(
                Instant::now() < deadline,
                "group {} synced nothing on node 1",
                handle.group()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    handles.remove(&1);
    cluster.stop(1).await;
    let host1 = cluster.start(1).await.clone();
    let mut recovered = host1.recovered_groups();
    recovered.sort_unstable();
    assert_eq!(recovered, (1..=GROUPS).collect::<Vec<_>>());
    let resumed = start_groups(&host1, &[1, 2, 3]).await;
    for group in 1..=4u64 {
        let length = propose(&resumed[&group], format!("{group}-after-restart")).await;
        assert_eq!(length, expected[&group].len() + 1);
        let lines = read(&resumed[&group]).await;
        assert_eq!(lines[..expected[&group].len()], expected[&group][..]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_start_stop_and_are_destroyed_at_run_time() {
    let mut cluster = Cluster::new("lifecycle", 1);
    let host = cluster.start(1).await.clone();
    let handle = host
        .start_group(5, Membership::Found(vec![1]), Journal::default())
        .await
        .unwrap();
    propose(&handle, "one".into()).await;
    assert!(matches!(
        host.start_group(5, Membership::Found(vec![1]), Journal::default())
            .await,
        Err(GroupError::AlreadyRunning { group: 5 })
    ));
    host.stop_group(5).await.unwrap();
    assert!(matches!(
        handle.propose(b"two".to_vec()).await,
        Err(GroupError::NotRunning { group: 5 })
    ));
    // Started again, it resumes from the log.
    let handle = host
        .start_group(5, Membership::Found(vec![1]), Journal::default())
        .await
        .unwrap();
    assert_eq!(propose(&handle, "two".into()).await, 2);
    // Destroyed, it is gone: started again, it is new.
    host.destroy_group(5).await.unwrap();
    let handle = host
        .start_group(5, Membership::Found(vec![1]), Journal::default())
        .await
        .unwrap();
    assert_eq!(propose(&handle, "fresh".into()).await, 1);
    drop(cluster.hosts.remove(&1));
    host.shutdown().await;
}

/// Snapshot files of `group` in a node's snapshot directory.
fn snapshot_files(cluster: &Cluster, id: u64, group: u64) -> Vec<String> {
    std::fs::read_dir(cluster.dir.join(format!("node-{id}/snapshots")))
        .map(|entries| {
            entries
                .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|name| {
                    name.starts_with(&format!("g{group:020}-")) && name.ends_with(".snap")
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_that_does_not_restore_is_refused_and_the_next_is_installed() {
    let mut cluster = Cluster::new("refused", 3);
    let handles = cluster.start_journals(2).await;
    let value = "y".repeat(200);
    for i in 0..40 {
        propose(&handles[&1], format!("{i}-{value}")).await;
    }
    let expected = read(&handles[&1]).await;
    // Node 3 comes up late and refuses every snapshot for a while.
    let refuse = Arc::new(AtomicBool::new(true));
    let mut config = cluster.config(3);
    config.snapshot_policy.log_bytes_min = u64::MAX;
    let host3 = NodeHost::start(config).await.unwrap();
    cluster.hosts.insert(3, host3.clone());
    let late = host3
        .start_group(
            1,
            Membership::Found(vec![1, 2, 3]),
            Journal {
                refuse_restores: Some(refuse.clone()),
                ..Journal::default()
            },
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Refused: nothing installed, and the machine holds at most what plain
    // appends gave it before the leader's log ran out (a prefix), and the
    // group on it still answers.
    assert!(snapshot_files(&cluster, 3, 1).is_empty());
    let local = late
        .query((), ReadConsistency::Local { min_applied: None })
        .await
        .unwrap();
    assert!(
        local.len() < expected.len() && expected.starts_with(&local),
        "node 3 holds {} lines of {} from a refused snapshot",
        local.len(),
        expected.len()
    );
    // The leader sends it again; this time it restores.
    refuse.store(false, Ordering::SeqCst);
    wait_for_lines(&late, &expected, "node 3 (after refusing)").await;
    assert!(!snapshot_files(&cluster, 3, 1).is_empty());
}

#[tokio::test]
async fn a_host_whose_log_lost_synced_data_refuses_to_start() {
    let cluster = Cluster::new("lost", 1);
    let dir = cluster.dir.join("node-1");
    // The node voted in term 4, durably.
    {
        let (mut storage, _) = ferry_storage::Storage::open(
            ferry_storage::FsDisk,
            &dir,
            ferry_storage::WalOptions::default(),
        )
        .unwrap();
        let vote = ferry_runtime::ferry_raft::PersistRequest {
            seq: 1,
            hard_state: Some(ferry_runtime::ferry_raft::HardState {
                term: 4,
                vote: Some(2),
                commit: 0,
            }),
            entries: Vec::new(),
        };
        storage.wal.append(1, &vote).unwrap();
        storage.wal.sync().unwrap();
    }
    // Its only segment is lost.
    for entry in std::fs::read_dir(dir.join("wal")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "seg") {
            std::fs::remove_file(path).unwrap();
        }
    }
    let error = match NodeHost::start(cluster.config(1)).await {
        Err(error) => error,
        Ok(host) => {
            host.shutdown().await;
            panic!("a host that forgot its vote started");
        }
    };
    assert!(
        matches!(
            &error,
            ferry_runtime::HostError::Storage {
                source: ferry_storage::StorageError::LostSyncedData { .. },
                ..
            }
        ),
        "{error}"
    );
    let text = error.to_string();
    assert!(text.contains("must not start as a voter"), "{text}");
    assert!(text.contains("When the disk lies: the way back"), "{text}");
}

/// A machine that keeps its state in a file of its own: one line per
/// command, made durable every few commands.
struct FileJournal {
    path: PathBuf,
    lines: Vec<(u64, String)>,
    durable_index: u64,
    /// Commands this machine applied since it was created.
    applies: Arc<std::sync::atomic::AtomicU64>,
    /// From this index on (0: never) its disk fails: applies answer an
    /// [`ApplyError`] and change nothing.
    failing_from: Arc<std::sync::atomic::AtomicU64>,
}

impl FileJournal {
    fn open(path: PathBuf, applies: Arc<std::sync::atomic::AtomicU64>) -> FileJournal {
        let lines = Self::parse(&std::fs::read_to_string(&path).unwrap_or_default());
        let durable_index = lines.last().map_or(0, |(index, _)| *index);
        FileJournal {
            path,
            lines,
            durable_index,
            applies,
            failing_from: Arc::default(),
        }
    }

    fn parse(text: &str) -> Vec<(u64, String)> {
        text.lines()
            .filter_map(|line| {
                let (index, data) = line.split_once('\t')?;
                Some((index.parse().ok()?, data.to_owned()))
            })
            .collect()
    }

    fn encode(&self) -> String {
        self.lines
            .iter()
            .map(|(index, data)| format!("{index}\t{data}\n"))
            .collect()
    }

    fn save(&mut self) {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, self.encode()).unwrap();
        std::fs::File::open(&tmp).unwrap().sync_all().unwrap();
        std::fs::rename(&tmp, &self.path).unwrap();
        self.durable_index = self.lines.last().map_or(0, |(index, _)| *index);
    }
}

impl StateMachine for FileJournal {
    type Response = usize;
    type Query = ();
    type QueryResponse = Vec<String>;

    fn apply(&mut self, command: Command<'_>) -> Result<usize, ApplyError> {
        let failing_from = self.failing_from.load(Ordering::SeqCst);
        if failing_from != 0 && command.index >= failing_from {
            return Err(ApplyError::new(format!(
                "{}: input/output error",
                self.path.display()
            )));
        }
        self.applies.fetch_add(1, Ordering::SeqCst);
        self.lines.push((
            command.index,
            String::from_utf8_lossy(command.data).into_owned(),
        ));
        if self.lines.len() % 5 == 0 {
            self.save();
        }
        Ok(self.lines.len())
    }

    fn query(&self, (): ()) -> Vec<String> {
        self.lines.iter().map(|(_, data)| data.clone()).collect()
    }

    fn snapshot(&self) -> Box<dyn SnapshotSource> {
        Box::new(BytesSnapshot(self.encode().into_bytes().into()))
    }

    fn restore(&mut self, snapshot: &mut dyn std::io::Read) -> Result<(), RestoreError> {
        let snapshot_bytes = read_snapshot(snapshot)?;
        let snapshot = snapshot_bytes.as_slice();
        let text = std::str::from_utf8(snapshot).map_err(|e| RestoreError::new(e.to_string()))?;
        self.lines = Self::parse(text);
        self.save();
        Ok(())
    }

    fn durability(&self) -> ferry_runtime::Durability {
        ferry_runtime::Durability::Durable
    }

    fn durable_index(&self) -> u64 {
        self.durable_index
    }

    fn applied_index(&self) -> u64 {
        self.lines.last().map_or(0, |(index, _)| *index)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_machine_is_compacted_behind_streamed_to_a_late_member_and_not_replayed() {
    let mut cluster = Cluster::new("durable", 3);
    std::fs::create_dir_all(&cluster.dir).unwrap();
    let journal = |cluster: &Cluster, id: u64| {
        let applies = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let machine = FileJournal::open(cluster.dir.join(format!("journal-{id}")), applies.clone());
        (machine, applies)
    };
    let mut handles = BTreeMap::new();
    for id in 1..=2 {
        let host = cluster.start(id).await.clone();
        let (machine, _) = journal(&cluster, id);
        let handle = host
            .start_group(1, Membership::Found(vec![1, 2, 3]), machine)
            .await
            .unwrap();
        handles.insert(id, handle);
    }
    let value = "z".repeat(200);
    let mut expected = Vec::new();
    for i in 0..40 {
        let line = format!("{i}-{value}");
        expected.push(line.clone());
        let deadline = Instant::now() + Duration::from_secs(20);
        while let Err(error) = handles[&1].propose(line.clone().into_bytes()).await {
            assert!(
                !error.outcome_unknown() && Instant::now() < deadline,
                "{error}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // The log was compacted behind what the machines made durable, with
    // snapshot files that hold no state (markers).
    let markers: Vec<u64> = std::fs::read_dir(cluster.dir.join("node-1/snapshots"))
        .unwrap()
        .map(|entry| entry.unwrap())
        .filter(|entry| entry.file_name().to_string_lossy().ends_with(".snap"))
        .map(|entry| entry.metadata().unwrap().len())
        .collect();
    assert!(!markers.is_empty(), "no compaction marker was written");
    let state_bytes = std::fs::metadata(cluster.dir.join("journal-1"))
        .unwrap()
        .len();
    assert!(
        markers.iter().all(|bytes| *bytes < state_bytes / 4),
        "markers of {markers:?} bytes for a state of {state_bytes}"
    );
    // Node 3 starts late and is sent the state streamed from a view.
    let host3 = cluster.start(3).await.clone();
    let (machine, _) = journal(&cluster, 3);
    let late = host3
        .start_group(1, Membership::Found(vec![1, 2, 3]), machine)
        .await
        .unwrap();
    wait_for_lines(&late, &expected, "node 3").await;
    // It was caught up by the streamed state, not by the log alone.
    assert!(
        !snapshot_files(&cluster, 3, 1).is_empty(),
        "node 3 was caught up without a snapshot"
    );
    // Node 1 restarts: its machine holds its state, so nothing it holds is
    // applied again; only what follows.
    handles.remove(&1);
    cluster.stop(1).await;
    let host1 = cluster.start(1).await.clone();
    let (machine, applies) = journal(&cluster, 1);
    let resumed = host1
        .start_group(1, Membership::Found(vec![1, 2, 3]), machine)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match resumed.propose(b"after".to_vec()).await {
            Ok(length) => {
                assert_eq!(length, expected.len() + 1);
                break;
            }
            Err(error) => {
                assert!(
                    !error.outcome_unknown() && Instant::now() < deadline,
                    "{error}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    assert_eq!(
        applies.load(Ordering::SeqCst),
        1,
        "commands the machine held were applied again"
    );
    // Node 2's machine loses its own state (its file is gone): the log was
    // compacted behind that state, so the group refuses to start instead
    // of applying only what the log still holds.
    handles.remove(&2);
    cluster.stop(2).await;
    std::fs::remove_file(cluster.dir.join("journal-2")).unwrap();
    let host2 = cluster.start(2).await.clone();
    let (machine, applies) = journal(&cluster, 2);
    let refused = host2
        .start_group(1, Membership::Found(vec![1, 2, 3]), machine)
        .await
        .map(drop)
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("stands at index 0") && refused.contains("compacted through"),
        "{refused}"
    );
    assert_eq!(applies.load(Ordering::SeqCst), 0, "nothing was applied");
}

/// A member whose machine cannot apply a committed command (its disk
/// failed) stops the group there as a crash would: it does not skip the
/// command, its callers get `MachineFailed`, the others go on, and once it
/// starts again it applies the command it failed on and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_that_cannot_apply_stops_its_group_on_that_node_and_skips_nothing() {
    let mut cluster = Cluster::new("apply-failure", 3);
    std::fs::create_dir_all(&cluster.dir).unwrap();
    let mut handles = BTreeMap::new();
    let mut failing = BTreeMap::new();
    for id in 1..=3 {
        let host = cluster.start(id).await.clone();
        let machine = FileJournal::open(cluster.dir.join(format!("journal-{id}")), Arc::default());
        failing.insert(id, machine.failing_from.clone());
        let handle = host
            .start_group(1, Membership::Found(vec![1, 2, 3]), machine)
            .await
            .unwrap();
        handles.insert(id, handle);
    }
    let propose_through = |handle: GroupHandle<FileJournal>, line: String| async move {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match handle.propose(line.clone().into_bytes()).await {
                Ok(length) => return length,
                Err(error) => {
                    assert!(
                        !error.outcome_unknown() && Instant::now() < deadline,
                        "{error}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    };
    let mut expected = Vec::new();
    for i in 0..6 {
        expected.push(format!("before-{i}"));
        propose_through(handles[&1].clone(), expected[i].clone()).await;
    }
    // A follower's disk fails from the next entry on (a leader's failure
    // would leave proposals in doubt until the next election).
    let leader = handles[&1].view().leader.expect("a leader answered");
    let victim = (1..=3).find(|id| *id != leader).unwrap();
    let others: Vec<u64> = (1..=3).filter(|id| *id != victim).collect();
    wait_for_lines(&handles[&victim], &expected, "the follower").await;
    let next = handles[&victim].view().applied + 1;
    failing[&victim].store(next, Ordering::SeqCst);
    for i in 0..6 {
        let line = format!("after-{i}");
        expected.push(line.clone());
        propose_through(handles[&others[i % 2]].clone(), line).await;
    }
    for id in &others {
        wait_for_lines(&handles[id], &expected, "a healthy member").await;
    }
    // The follower stopped at the entry it could not apply, and says so.
    let deadline = Instant::now() + Duration::from_secs(20);
    while handles[&victim].view().halted.is_none() {
        assert!(
            Instant::now() < deadline,
            "the follower never reported its failure"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let view = handles[&victim].view();
    assert_eq!(
        view.applied,
        next - 1,
        "the follower applied past its failure"
    );
    assert!(view.leader.is_none());
    let halted = view.halted.unwrap();
    assert!(halted.contains(&format!("entry {next}")), "{halted}");
    assert!(halted.contains("input/output error"), "{halted}");
    let error = handles[&victim]
        .propose(b"refused".to_vec())
        .await
        .unwrap_err();
    assert!(
        matches!(error, GroupError::MachineFailed { index, .. } if index == next),
        "{error}"
    );
    assert!(error.outcome_unknown());
    let read = handles[&victim]
        .query((), ReadConsistency::Local { min_applied: None })
        .await
        .unwrap_err();
    assert!(matches!(read, GroupError::MachineFailed { .. }), "{read}");

    // Mended and started again, it applies what it failed on, and the rest.
    handles.remove(&victim);
    cluster.stop(victim).await;
    let host = cluster.start(victim).await.clone();
    let machine = FileJournal::open(
        cluster.dir.join(format!("journal-{victim}")),
        Arc::default(),
    );
    let restarted = host
        .start_group(1, Membership::Found(vec![1, 2, 3]), machine)
        .await
        .unwrap();
    wait_for_lines(&restarted, &expected, "the follower after its restart").await;
}

/// The view shows a membership change once it is in force, on the node
/// that made it (the configuration takes effect at commit, without the
/// log's end moving then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_shows_a_membership_change_once_it_is_in_force() {
    let mut cluster = Cluster::new("view-config", 1);
    let host = cluster.start(1).await.clone();
    let handle = host
        .start_group(3, Membership::Found(vec![1]), Journal::default())
        .await
        .unwrap();
    propose(&handle, "first".into()).await;
    handle
        .change_membership(ferry_runtime::MembershipChange::AddLearner(9))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !handle.view_with(|view| view.config.is_learner(9)) {
        assert!(
            Instant::now() < deadline,
            "the view never showed the new learner: {:?}",
            handle.view().config
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(cluster.hosts.remove(&1));
    host.shutdown().await;
}

/// The engine holds only a few settled entries in memory
/// (`log_memory_entries_max`); a member that starts late is caught up with
/// entries its leader reads back from the shared log, not with a snapshot
/// (the policy takes none here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_member_is_caught_up_from_entries_the_leader_reads_back_from_its_log() {
    let mut cluster = Cluster::new("loads", 3);
    let configure = |mut config: HostConfig| {
        config.snapshot_policy.log_bytes_min = u64::MAX;
        config.engine.log_memory_entries_max = 4;
        config
    };
    let mut handles = BTreeMap::new();
    for id in 1..=2 {
        let host = NodeHost::start(configure(cluster.config(id)))
            .await
            .unwrap();
        cluster.hosts.insert(id, host.clone());
        handles.insert(id, start_groups(&host, &[1, 2, 3]).await);
    }
    for group in 1..=2u64 {
        for i in 0..60 {
            propose(&handles[&1][&group], format!("{group}-{i}")).await;
        }
    }
    let mut expected = BTreeMap::new();
    for group in 1..=2u64 {
        expected.insert(group, read(&handles[&1][&group]).await);
    }
    let loaded_by_founders = |cluster: &Cluster| -> u64 {
        [1, 2]
            .iter()
            .map(|id| {
                cluster.hosts[id]
                    .log_counters()
                    .entries_loaded
                    .load(Ordering::Relaxed)
            })
            .sum()
    };
    let loaded_before = loaded_by_founders(&cluster);
    let host3 = NodeHost::start(configure(cluster.config(3))).await.unwrap();
    cluster.hosts.insert(3, host3.clone());
    let late = start_groups(&host3, &[1, 2, 3]).await;
    for group in 1..=2u64 {
        let what = format!("group {group} on the late node");
        wait_for_lines(&late[&group], &expected[&group], &what).await;
    }
    let loaded = loaded_by_founders(&cluster) - loaded_before;
    assert!(
        loaded >= 2 * 50,
        "the leaders read back only {loaded} entries for the late member"
    );
    let received = std::fs::read_dir(cluster.dir.join("node-3/snapshots"))
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter(|entry| entry.file_name().to_string_lossy().ends_with(".snap"))
                .count()
        })
        .unwrap_or(0);
    assert_eq!(received, 0, "the late member was sent a snapshot");
}

/// Waits, 20 s at most, until `done` holds, saying `what` otherwise.
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_measures_syncs_snapshots_round_trips_leaders_and_replication() {
    use ferry_runtime::metrics::peer_label;
    let mut cluster = Cluster::new("metrics", 3);
    let handles = cluster.start_journals(2).await;
    let value = "x".repeat(200);
    for i in 0..40 {
        propose(&handles[&1], format!("{i}-{value}")).await;
    }
    let expected = read(&handles[&1]).await;
    let leader = leader_of(&handles[&1]).await;
    let follower = 3 - leader;
    for id in [1, 2] {
        let metrics = cluster.hosts[&id].metrics();
        assert!(metrics.log_sync_seconds.count() > 0, "node {id} synced");
        assert!(
            metrics.snapshot_write_seconds.count() > 0,
            "node {id} wrote snapshots"
        );
        assert!(metrics.leader_changes.get() >= 1, "node {id} saw a leader");
        assert_eq!(metrics.proposals_pending.get(), 0);
    }
    // The leader knows how far each follower is; node 3 has nothing yet.
    let progress = handles[&leader].progress().await.unwrap();
    assert_eq!(progress.role, ferry_runtime::ferry_raft::Role::Leader);
    assert_eq!(progress.lag_entries()[&follower], 0);
    assert_eq!(progress.lag_entries()[&3], progress.last_index);
    let on_follower = handles[&follower].progress().await.unwrap();
    assert!(on_follower.match_index.is_empty(), "only a leader knows");
    assert!(cluster.hosts[&1]
        .queue_depths()
        .peer_frames
        .keys()
        .eq([2, 3].iter()));
    // Round trips to the live peer are measured by its pongs.
    let host1 = cluster.hosts[&1].clone();
    wait_until("a round trip from node 1 to node 2", || {
        host1
            .metrics()
            .peer_round_trip_seconds
            .get(&peer_label(2))
            .is_some_and(|histogram| histogram.count() > 0)
    })
    .await;
    assert!(
        host1
            .metrics()
            .peer_round_trip_seconds
            .get(&peer_label(3))
            .is_none(),
        "node 3 never answered"
    );

    // Node 3 starts late and is caught up from a snapshot.
    let mut config = cluster.config(3);
    config.snapshot_policy.log_bytes_min = u64::MAX;
    let host3 = NodeHost::start(config).await.unwrap();
    cluster.hosts.insert(3, host3.clone());
    let late = host3
        .start_group(1, Membership::Found(vec![1, 2, 3]), Journal::default())
        .await
        .unwrap();
    wait_for_lines(&late, &expected, "the late node").await;
    assert!(host3.metrics().snapshots_received.get() >= 1);
    assert!(cluster.hosts[&leader].metrics().snapshots_sent.get() >= 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    while handles[&leader].progress().await.unwrap().lag_entries()[&3] > 0 {
        assert!(Instant::now() < deadline, "node 3 never caught up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proposal_whose_caller_stops_waiting_counts_as_failed() {
    let mut cluster = Cluster::new("failed", 3);
    // One founder of three: no quorum, so no proposal can succeed.
    let host = cluster.start(1).await.clone();
    let handle = host
        .start_group(1, Membership::Found(vec![1, 2, 3]), Journal::default())
        .await
        .unwrap();
    let mut proposal = Box::pin(handle.propose(b"never".to_vec()));
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut proposal)
            .await
            .is_err(),
        "no quorum, no answer"
    );
    assert_eq!(host.metrics().proposals_pending.get(), 1);
    assert_eq!(host.metrics().proposals_failed.get(), 0);
    drop(proposal);
    assert_eq!(host.metrics().proposals_pending.get(), 0);
    assert_eq!(host.metrics().proposals_failed.get(), 1);
}

/// Linearizable reads on a follower asked at the same time share read
/// index rounds, and each still sees every write acknowledged before it
/// asked: 20 times, a write through the leader, then 50 reads at once on a
/// follower (a barrier, then the machine at the index it returned).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_asked_together_share_a_read_index_round_and_see_every_write_before_them() {
    let mut cluster = Cluster::new("shared-reads", 3);
    let handles = cluster.start_journals(3).await;
    let leader = leader_of(&handles[&1]).await;
    let follower = if leader == 1 { 2 } else { 1 };
    propose(&handles[&leader], "warm-up".to_owned()).await;
    read(&handles[&follower]).await;
    let rounds_before = cluster.hosts[&follower].metrics().read_rounds.get();
    const WRITES: usize = 20;
    const READS_PER_WRITE: usize = 50;
    for i in 0..WRITES {
        let line = format!("write-{i}");
        propose(&handles[&leader], line.clone()).await;
        let mut reads = tokio::task::JoinSet::new();
        for _ in 0..READS_PER_WRITE {
            let handle = handles[&follower].clone();
            reads.spawn(async move {
                let index = handle
                    .read_barrier(ReadConsistency::Linearizable)
                    .await
                    .unwrap();
                handle
                    .query(
                        (),
                        ReadConsistency::Local {
                            min_applied: Some(index),
                        },
                    )
                    .await
                    .unwrap()
            });
        }
        while let Some(lines) = reads.join_next().await {
            let lines = lines.unwrap();
            assert_eq!(lines.last(), Some(&line), "a read missed write {i}");
        }
    }
    let rounds = cluster.hosts[&follower].metrics().read_rounds.get() - rounds_before;
    let reads = (WRITES * READS_PER_WRITE) as u64;
    assert!(rounds >= WRITES as u64, "{rounds} rounds");
    assert!(
        rounds * 5 <= reads,
        "{reads} reads took {rounds} read index rounds"
    );
}

/// The task that runs shared read barriers lives on the runtime of the
/// caller that started it. When that runtime shuts down with a barrier in
/// flight (here: the leader has lost its quorum, so the barrier waits), the
/// callers after it must not wait for a task that is gone: they ask again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_that_goes_away_mid_read_does_not_leave_later_reads_waiting() {
    let mut cluster = Cluster::new("shared-reads-runtime", 3);
    let handles = cluster.start_journals(2).await;
    let leader = leader_of(&handles[&1]).await;
    propose(&handles[&leader], "before".to_owned()).await;
    // The leader's barriers now wait for a quorum that does not answer.
    cluster.stop(3 - leader).await;
    let handle = handles[&leader].clone();
    let caller = handle.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            // Starts the runner on this runtime, and stops waiting.
            let _ = tokio::time::timeout(
                Duration::from_millis(50),
                caller.read_barrier(ReadConsistency::Linearizable),
            )
            .await;
        });
        // The runner is dropped here, its barrier in flight.
        drop(runtime);
    })
    .join()
    .unwrap();
    // Answered (an error: no quorum) within the engine's request timeout,
    // not left waiting for the runner that is gone.
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        handle.read_barrier(ReadConsistency::Linearizable),
    )
    .await;
    assert!(answer.is_ok(), "a read after the runtime went away waited");
}
