//! Redis for the tests (feature `redis`): the single server of `REDIS_URL` and the cluster of
//! `TI_REDIS_CLUSTER_URLS` (`scripts/test.sh` starts both when they are not running). Each
//! store gets a key prefix of its own, so tests never meet.

use std::time::Duration;

use tower_idempotency::RedisStore;

/// The single server: `REDIS_URL`, or the local service.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned())
}

/// The cluster's nodes: `TI_REDIS_CLUSTER_URLS` (comma-separated), or the six loopback
/// nodes `scripts/test.sh` starts (ports 21001-21006).
pub fn cluster_urls() -> Vec<String> {
    match std::env::var("TI_REDIS_CLUSTER_URLS") {
        Ok(urls) if !urls.is_empty() => urls.split(',').map(str::to_owned).collect(),
        _ => (21001..=21006)
            .map(|port| format!("redis://127.0.0.1:{port}"))
            .collect(),
    }
}

/// A prefix no other test (or test process) uses.
pub fn prefix() -> String {
    format!("ti-test:{}:", super::unique())
}

/// A store on the single server, with a prefix of its own.
pub fn store(prefix: &str) -> RedisStore {
    RedisStore::open(&redis_url())
        .expect("REDIS_URL is a Redis URL")
        .with_prefix(prefix)
}

/// A store on the single server, on a connection of its own (another app instance).
pub async fn connected_store(prefix: &str) -> RedisStore {
    let client = ::redis::Client::open(redis_url()).unwrap();
    let manager = ::redis::aio::ConnectionManager::new(client)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "no Redis at {} ({e}); run scripts/test.sh, which starts one",
                redis_url()
            )
        });
    RedisStore::new(manager).with_prefix(prefix)
}

/// A store on the cluster, with a prefix of its own.
pub async fn cluster_store(prefix: &str) -> RedisStore {
    let client = ::redis::cluster::ClusterClient::builder(cluster_urls())
        .connection_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let conn = client.get_async_connection().await.unwrap_or_else(|e| {
        panic!(
            "no Redis Cluster at {:?} ({e}); run scripts/test.sh, which starts one",
            cluster_urls()
        )
    });
    RedisStore::cluster(conn).with_prefix(prefix)
}

/// A client for wake-ups ([`RedisStore::with_notifications`]) on the single server.
pub fn client() -> ::redis::Client {
    ::redis::Client::open(redis_url()).unwrap()
}

/// A client for wake-ups on the cluster (any node hears every `PUBLISH`).
pub fn cluster_client() -> ::redis::Client {
    ::redis::Client::open(cluster_urls()[0].as_str()).unwrap()
}
