//! [`PgSchema`]: the fresh schema and pool each Postgres scenario works in, emptied before
//! each side of a new-key scenario and dropped at the end, and the process IDs of the pool's
//! backends (for their CPU time).

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::{BoxError, common};

pub(crate) struct PgSchema {
    name: String,
    admin: PgPool,
    pub(crate) pool: PgPool,
    /// The tables emptied before each side of a new-key scenario.
    pub(crate) tables: Vec<&'static str>,
}

impl PgSchema {
    pub(crate) async fn new(pool_size: u32) -> Result<Self, BoxError> {
        let (admin, name, opts) = common::fresh_schema("bench").await?;
        let pool = PgPoolOptions::new()
            .max_connections(pool_size)
            .min_connections(pool_size)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(opts)
            .await?;
        // Open every connection now, so the backends whose CPU time is counted are all there.
        let mut held = Vec::new();
        for _ in 0..pool_size {
            held.push(pool.acquire().await?);
        }
        drop(held);
        Ok(Self {
            name,
            admin,
            pool,
            tables: vec!["tower_idempotency_keys"],
        })
    }

    /// The process IDs of the pool's server backends (found by their application name).
    pub(crate) async fn backend_pids(&self) -> Result<Vec<u32>, BoxError> {
        let pids: Vec<i32> =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
                .bind(&self.name)
                .fetch_all(&self.admin)
                .await?;
        Ok(pids
            .into_iter()
            .filter_map(|p| u32::try_from(p).ok())
            .collect())
    }

    pub(crate) async fn truncate(&self) -> Result<(), BoxError> {
        let sql = format!("TRUNCATE {}", self.tables.join(", "));
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub(crate) async fn drop_schema(self) {
        self.pool.close().await;
        let sql = format!("DROP SCHEMA {} CASCADE", self.name);
        if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&self.admin)
            .await
        {
            eprintln!("could not drop schema {}: {e}", self.name);
        }
        self.admin.close().await;
    }
}
