//! A real gRPC server on 127.0.0.1 (port 0) for the integration tests.

// Each test file uses a part of this module.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_server::api::{spawn_server, ApiOptions, EtcdApi};
use ferry_server::backend::Backend;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// A running server. Sending on (or dropping) `stop` shuts it down; `task`
/// ends once it has.
pub struct TestServer {
    pub address: SocketAddr,
    pub task: JoinHandle<()>,
    pub stop: oneshot::Sender<()>,
}

/// Serves the API over `backend` on a free loopback port.
pub async fn start<B: Backend>(backend: Arc<B>, options: ApiOptions) -> TestServer {
    let (stop, stopped) = oneshot::channel::<()>();
    let (address, task) = spawn_server(
        EtcdApi::new(backend, options),
        "127.0.0.1:0".parse().unwrap(),
        async {
            let _ = stopped.await;
        },
    )
    .await
    .unwrap();
    TestServer {
        address,
        task,
        stop,
    }
}

/// A client channel to the server at `address`.
pub async fn connect(address: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}
