//! One running contender: built and served on the server runtime, reached from the client
//! runtime.

use std::net::SocketAddr;

use anyhow::{Context, Result, bail};
use tokio::runtime::Handle;

use crate::app::{self, Counters, Server};
use crate::contenders::{self, Contender, Shutdown};
use crate::http::{Common, Conn, write_bare_request};

/// The cookie sent to contenders that need no session: the same header, the same length.
const NO_SESSION: &str = "session=AAAAAAAAAAAAAAAAAAAAAA";

pub struct Instance {
    pub addr: SocketAddr,
    pub counters: Counters,
    pub common: Common,
    server: Server,
    shutdown: Shutdown,
}

impl Instance {
    /// A fresh instance of `contender` (new store and pool, emptied tables).
    pub async fn start(server_rt: &Handle, contender: &Contender, db_url: &str) -> Result<Self> {
        checkpoint(db_url).await;
        let counters = Counters::default();
        let (kind, db_url, c) = (contender.kind, db_url.to_owned(), counters.clone());
        let (server, needs_login, shutdown) = server_rt
            .spawn(async move {
                let built = contenders::build(kind, c, &db_url).await?;
                let server = Server::start(app::with_auth(built.router)).await?;
                anyhow::Ok((server, built.needs_login, built.shutdown))
            })
            .await
            .context("building the contender panicked")?
            .with_context(|| format!("starting {}", contender.name))?;
        let mut common = Common {
            host: server.addr.to_string(),
            cookie: NO_SESSION.to_owned(),
        };
        if needs_login {
            common.cookie = login(server.addr, &common)
                .await
                .with_context(|| format!("opening a session on {}", contender.name))?;
        }
        Ok(Self {
            addr: server.addr,
            counters,
            common,
            server,
            shutdown,
        })
    }

    /// Stops the server and closes the contender's pools.
    pub async fn stop(self, server_rt: &Handle) -> Result<()> {
        let (server, shutdown) = (self.server, self.shutdown);
        server_rt
            .spawn(async move {
                let stopped = server.stop().await;
                shutdown.await;
                stopped
            })
            .await
            .context("stopping the contender panicked")?
    }
}

/// Flushes Postgres's dirty pages, so that no run inherits the previous one's writes (or a
/// checkpoint they would trigger). Best effort: it needs a superuser (or `pg_checkpoint`).
async fn checkpoint(db_url: &str) {
    use sqlx::Connection as _;
    if let Ok(mut conn) = sqlx::PgConnection::connect(db_url).await {
        let _ = sqlx::raw_sql("CHECKPOINT").execute(&mut conn).await;
        let _ = conn.close().await;
    }
}

/// `POST /login`, and the `name=value` of the session cookie it sets.
async fn login(addr: SocketAddr, common: &Common) -> Result<String> {
    let mut conn = Conn::connect(addr).await?;
    let mut buf = Vec::new();
    write_bare_request(&mut buf, common, "/login");
    let reply = conn.exchange(&buf).await?;
    if !(200..300).contains(&reply.status) {
        bail!("POST /login answered {}", reply.status);
    }
    let prefix = format!("{}=", contenders::SESSION_COOKIE);
    reply
        .headers
        .iter()
        .filter(|(name, _)| name == "set-cookie")
        .filter_map(|(_, value)| std::str::from_utf8(value).ok())
        .find(|value| value.starts_with(&prefix))
        .and_then(|value| value.split(';').next())
        .map(str::to_owned)
        .context("POST /login set no session cookie")
}
