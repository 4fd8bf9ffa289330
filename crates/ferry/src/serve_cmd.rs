//! `ferry serve`: run one node of a cluster.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use ferry_server::runtime::{start_node, MemberAddrs, NodeConfig};

/// Arguments of `ferry serve`. Every option may also come from a TOML file
/// (`--config`); a flag given on the command line wins over the file.
#[derive(clap::Args, Debug, Default)]
pub struct ServeArgs {
    /// A TOML file with any of the options below, by their long names with
    /// dashes as underscores (e.g. `data_dir = "/var/lib/ferry"`, `member =
    /// ["1=10.0.0.1:2380,http://10.0.0.1:2379", ...]`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// This node's id: a nonzero integer, unique in the cluster, that never
    /// changes (it names the node in the log and to its peers).
    #[arg(long)]
    pub id: Option<u64>,
    /// The directory for this node's log and snapshots. Created if missing;
    /// on restart the node resumes from it. [default: ./ferry-data]
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Where to serve the etcd v3 gRPC API. [default: 127.0.0.1:2379]
    #[arg(long, value_name = "ADDR")]
    pub listen_client: Option<SocketAddr>,
    /// Where to accept connections from the other nodes. [default: 127.0.0.1:2380]
    #[arg(long, value_name = "ADDR")]
    pub listen_peer: Option<SocketAddr>,
    /// A founding member, as `ID=PEER_ADDR,CLIENT_URL` (e.g.
    /// `2=127.0.0.1:22380,http://127.0.0.1:22379`). Give every member,
    /// this node included, with the same list on every node. Without any,
    /// the node founds a one-member cluster of itself.
    #[arg(long, value_name = "MEMBER")]
    pub member: Vec<String>,
    /// The cluster id, a hexadecimal number every node of the cluster shares;
    /// a node refuses peers with another. [default: f3e7700000000001]
    #[arg(long, value_name = "HEX")]
    pub cluster_id: Option<String>,
    /// The length of one Raft tick in milliseconds; the election timeout is
    /// 10 to 20 ticks and the leader sends heartbeats every tick. [default: 100]
    #[arg(long, value_name = "MS")]
    pub tick_ms: Option<u64>,
    /// Take a snapshot of the key-value state after this many log entries
    /// (followers far behind are sent the snapshot). [default: 10000]
    #[arg(long, value_name = "ENTRIES")]
    pub snapshot_entries: Option<u64>,
    /// Join a running cluster instead of founding one. First add this node
    /// with `etcdctl member add NAME --peer-urls=http://PEER_ADDR [--learner]`
    /// and start it with the id that call printed (in decimal), an empty
    /// data directory, and `--member` for this node and at least one
    /// current member. It learns the log and the configuration from the
    /// leader. On later restarts the flag is ignored: the data directory
    /// already knows the cluster.
    #[arg(long)]
    pub join: bool,
    /// Log entries kept behind a snapshot, so that a follower a little
    /// behind is sent those entries rather than the whole snapshot. [default: 1000]
    #[arg(long, value_name = "ENTRIES")]
    pub compaction_lag_entries: Option<u64>,
}

/// The TOML form of [`ServeArgs`].
#[derive(serde::Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct ServeFile {
    id: Option<u64>,
    data_dir: Option<PathBuf>,
    listen_client: Option<SocketAddr>,
    listen_peer: Option<SocketAddr>,
    #[serde(default)]
    member: Vec<String>,
    cluster_id: Option<String>,
    tick_ms: Option<u64>,
    snapshot_entries: Option<u64>,
    compaction_lag_entries: Option<u64>,
    join: Option<bool>,
}

/// Parses `ID=PEER_ADDR,CLIENT_URL`.
fn parse_member(text: &str) -> Result<(u64, MemberAddrs), String> {
    let (id, addrs) = text
        .split_once('=')
        .ok_or_else(|| format!("member {text:?}: expected ID=PEER_ADDR,CLIENT_URL"))?;
    let id: u64 = id
        .trim()
        .parse()
        .map_err(|_| format!("member {text:?}: the id {id:?} is not a positive integer"))?;
    if id == 0 {
        return Err(format!("member {text:?}: ids start at 1"));
    }
    let (peer_addr, client_url) = addrs
        .split_once(',')
        .ok_or_else(|| format!("member {text:?}: expected ID=PEER_ADDR,CLIENT_URL"))?;
    let client_url = client_url.trim().to_string();
    if !client_url.starts_with("http://") {
        return Err(format!(
            "member {text:?}: the client URL must start with http://"
        ));
    }
    Ok((
        id,
        MemberAddrs {
            name: format!("ferry-{id}"),
            peer_addr: peer_addr.trim().to_string(),
            client_url,
        },
    ))
}

/// Merges flags over the file and fills in defaults.
fn node_config(args: ServeArgs) -> Result<NodeConfig, String> {
    let file = match &args.config {
        None => ServeFile::default(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
            toml::from_str(&text).map_err(|error| format!("{}: {error}", path.display()))?
        }
    };
    let id = args
        .id
        .or(file.id)
        .ok_or("--id is required (a nonzero integer unique in the cluster)")?;
    if id == 0 {
        return Err("--id must be nonzero".into());
    }
    let data_dir = args
        .data_dir
        .or(file.data_dir)
        .unwrap_or_else(|| PathBuf::from("ferry-data"));
    let default_client = SocketAddr::from(([127, 0, 0, 1], 2379));
    let default_peer = SocketAddr::from(([127, 0, 0, 1], 2380));
    let listen_client = args
        .listen_client
        .or(file.listen_client)
        .unwrap_or(default_client);
    let listen_peer = args
        .listen_peer
        .or(file.listen_peer)
        .unwrap_or(default_peer);
    let member_texts = if args.member.is_empty() {
        file.member
    } else {
        args.member
    };
    let mut members = BTreeMap::new();
    for text in &member_texts {
        let (member_id, addrs) = parse_member(text)?;
        if members.insert(member_id, addrs).is_some() {
            return Err(format!("member {member_id} is listed twice"));
        }
    }
    if members.is_empty() {
        members.insert(
            id,
            MemberAddrs {
                name: format!("ferry-{id}"),
                peer_addr: listen_peer.to_string(),
                client_url: format!("http://{listen_client}"),
            },
        );
    }
    if !members.contains_key(&id) {
        return Err(format!(
            "this node's id {id} is not among the members {:?}",
            members.keys().collect::<Vec<_>>()
        ));
    }
    let mut config = NodeConfig::new(id, data_dir, listen_client, listen_peer, members);
    if let Some(hex) = args.cluster_id.or(file.cluster_id) {
        config.cluster_id = u64::from_str_radix(hex.trim_start_matches("0x"), 16)
            .map_err(|_| format!("--cluster-id {hex:?} is not a hexadecimal number"))?;
    }
    if let Some(tick_ms) = args.tick_ms.or(file.tick_ms) {
        if tick_ms == 0 {
            return Err("--tick-ms must be at least 1".into());
        }
        config.tick_interval = Duration::from_millis(tick_ms);
    }
    if let Some(entries) = args.snapshot_entries.or(file.snapshot_entries) {
        config.snapshot_interval_entries = entries.max(1);
    }
    config.join = args.join || file.join.unwrap_or(false);
    if let Some(entries) = args.compaction_lag_entries.or(file.compaction_lag_entries) {
        config.compaction_lag_entries = entries;
    }
    Ok(config)
}

/// Runs `ferry serve` until SIGINT or SIGTERM.
pub fn run(args: ServeArgs) -> ExitCode {
    crate::init_logging();
    let config = match node_config(args) {
        Ok(config) => config,
        Err(message) => {
            eprintln!("ferry serve: {message}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("ferry serve: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let node_id = config.node_id;
        let data_dir = config.data_dir.clone();
        let mut node = match start_node(config).await {
            Ok(node) => node,
            Err(error) => {
                eprintln!("ferry serve: node {node_id} cannot start: {error}");
                return ExitCode::FAILURE;
            }
        };
        tracing::info!(
            node = node_id,
            client = %node.client_addr,
            peer = %node.peer_addr,
            data = %data_dir.display(),
            "serving"
        );
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(error) => {
                    eprintln!("ferry serve: cannot listen for SIGTERM: {error}");
                    return ExitCode::FAILURE;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
            _ = terminate.recv() => tracing::info!("SIGTERM: stopping"),
            _ = node.stopped() => {
                eprintln!("ferry serve: node {node_id} stopped after an error (see the log above)");
                return ExitCode::FAILURE;
            }
        }
        node.shutdown().await;
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_parse_and_bad_ones_say_why() {
        let (id, addrs) = parse_member("2=127.0.0.1:22380,http://127.0.0.1:22379").unwrap();
        assert_eq!(id, 2);
        assert_eq!(addrs.peer_addr, "127.0.0.1:22380");
        assert_eq!(addrs.client_url, "http://127.0.0.1:22379");
        assert!(parse_member("x=a,http://b")
            .unwrap_err()
            .contains("not a positive integer"));
        assert!(parse_member("0=a,http://b")
            .unwrap_err()
            .contains("start at 1"));
        assert!(parse_member("1=a").unwrap_err().contains("expected"));
        assert!(parse_member("1=a,b").unwrap_err().contains("http://"));
    }

    #[test]
    fn a_node_must_be_among_its_members() {
        let args = ServeArgs {
            id: Some(3),
            member: vec!["1=127.0.0.1:1,http://127.0.0.1:2".into()],
            ..ServeArgs::default()
        };
        assert!(node_config(args)
            .unwrap_err()
            .contains("not among the members"));
    }

    #[test]
    fn a_lone_node_founds_a_cluster_of_itself() {
        let config = node_config(ServeArgs {
            id: Some(1),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(config.members.keys().copied().collect::<Vec<_>>(), vec![1]);
        assert_eq!(config.client_listen.port(), 2379);
    }
}
