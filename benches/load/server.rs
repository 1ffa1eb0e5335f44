//! The server a side runs on: the side's router, served by axum on `127.0.0.1:0` in the
//! server runtime, stopped gracefully when the side ends.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use tokio::runtime::Runtime;

use crate::BoxError;

pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

pub(crate) fn start_server(rt: &Runtime, router: Router) -> Result<Server, BoxError> {
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
        });
        Ok(Server { addr, stop, task })
    })
}

pub(crate) fn stop_server(rt: &Runtime, server: Server) {
    let _ = server.stop.send(());
    rt.block_on(async {
        let abort = server.task.abort_handle();
        match tokio::time::timeout(Duration::from_secs(5), server.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => eprintln!("server failed: {e}"),
            Ok(Err(e)) => eprintln!("server task failed: {e}"),
            Err(_) => {
                eprintln!("server did not stop within 5 s; aborting it");
                abort.abort();
            }
        }
    });
}
