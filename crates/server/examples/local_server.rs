//! Serves the etcd v3 API from the in-process single-node backend (no Raft,
//! nothing on disk), for trying etcdctl against ferry's API layer:
//!
//! ```text
//! cargo run -p ferry-server --example local_server -- 127.0.0.1:2379
//! ```

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use ferry_server::api::{spawn_server, ApiOptions, EtcdApi};
use ferry_server::backend::LocalBackend;
use ferry_server::kv_state::KvLimits;
use ferry_server::watch::WatchLimits;

#[tokio::main]
async fn main() -> ExitCode {
    let address_text = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:2379".to_string());
    let address: SocketAddr = match address_text.parse() {
        Ok(address) => address,
        Err(error) => {
            eprintln!("local_server: cannot parse listen address {address_text:?}: {error}");
            return ExitCode::from(2);
        }
    };
    let backend = Arc::new(LocalBackend::new(
        KvLimits::default(),
        WatchLimits::default(),
        format!("http://{address}"),
    ));
    backend.spawn_lease_expiry(Duration::from_millis(100));
    let api = EtcdApi::new(backend, ApiOptions::default());
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let (bound, task) = match spawn_server(api, address, shutdown).await {
        Ok(started) => started,
        Err(error) => {
            eprintln!("local_server: cannot listen on {address}: {error}");
            return ExitCode::FAILURE;
        }
    };
    println!("ferry local_server: etcd v3 API on http://{bound} (in-process backend, no Raft)");
    match task.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("local_server: server task failed: {error}");
            ExitCode::FAILURE
        }
    }
}
