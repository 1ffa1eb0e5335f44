//! The correctness checks run against each contender before the load: a repeated request is
//! answered byte for byte as the first, and concurrent duplicates run the handler once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::sync::Barrier;

use crate::app::{Counters, SLOW_HANDLER};
use crate::http::{Common, Conn, Key, Reply, write_request};
use crate::instance::Instance;

/// How many duplicates are released together.
pub const DUPLICATES: usize = 10;

pub struct Report {
    pub first_status: u16,
    pub identical: bool,
    /// What differed between the first answer and the repeat (status, body), and which
    /// headers the repeat added or dropped.
    pub differences: String,
    pub duplicate_runs: u64,
    pub duplicate_statuses: BTreeMap<u16, usize>,
}

impl Report {
    pub fn statuses(&self) -> String {
        self.duplicate_statuses
            .iter()
            .map(|(status, n)| format!("{status}×{n}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

pub async fn run(instance: &Instance, tag: u64) -> Result<Report> {
    let (first, repeat) = repeat_one(instance, Key(u128::from(tag) << 64 | 1))
        .await
        .context("the replay check")?;
    let (duplicate_runs, duplicate_statuses) = duplicates(instance, Key(u128::from(tag) << 64 | 2))
        .await
        .context("the concurrent-duplicates check")?;
    let identical = first.status == repeat.status && first.body == repeat.body;
    Ok(Report {
        first_status: first.status,
        identical,
        differences: differences(&first, &repeat),
        duplicate_runs,
        duplicate_statuses,
    })
}

async fn repeat_one(instance: &Instance, key: Key) -> Result<(Reply, Reply)> {
    let mut conn = Conn::connect(instance.addr).await?;
    let mut buf = Vec::new();
    write_request(&mut buf, &instance.common, "/orders", key, 7);
    let first = conn.exchange(&buf).await?;
    let repeat = conn.exchange(&buf).await?;
    Ok((first, repeat))
}

async fn duplicates(instance: &Instance, key: Key) -> Result<(u64, BTreeMap<u16, usize>)> {
    let counters: &Counters = &instance.counters;
    let before = counters.slow_orders();
    let barrier = Arc::new(Barrier::new(DUPLICATES));
    let mut tasks = Vec::with_capacity(DUPLICATES);
    for _ in 0..DUPLICATES {
        let mut conn = Conn::connect(instance.addr).await?;
        let (barrier, common): (_, Common) = (barrier.clone(), instance.common.clone());
        tasks.push(tokio::spawn(async move {
            let mut buf = Vec::new();
            write_request(&mut buf, &common, "/slow-orders", key, 3);
            barrier.wait().await;
            conn.exchange(&buf).await
        }));
    }
    let mut statuses = BTreeMap::new();
    for task in tasks {
        let reply = task.await.context("a duplicate's task panicked")??;
        *statuses.entry(reply.status).or_default() += 1;
    }
    // A handler that a layer left running in the background (or started late) counts too.
    tokio::time::sleep(SLOW_HANDLER + Duration::from_millis(100)).await;
    Ok((counters.slow_orders() - before, statuses))
}

fn differences(first: &Reply, repeat: &Reply) -> String {
    let mut out = Vec::new();
    if first.status != repeat.status {
        out.push(format!("status {} → {}", first.status, repeat.status));
    }
    if first.body != repeat.body {
        out.push(format!(
            "body {} → {}",
            shorten(&first.body),
            shorten(&repeat.body)
        ));
    }
    // `date` changes by nature; the rest is what the repeat added or dropped.
    let seen = |r: &Reply, name: &str, value: &[u8]| {
        r.headers
            .iter()
            .any(|(n, v)| n == name && v.as_slice() == value)
    };
    let mut headers = Vec::new();
    for (name, value) in &repeat.headers {
        if name != "date" && !seen(first, name, value) {
            headers.push(format!("+{name}"));
        }
    }
    for (name, value) in &first.headers {
        if name != "date" && !seen(repeat, name, value) {
            headers.push(format!("-{name}"));
        }
    }
    if !headers.is_empty() {
        out.push(format!("headers {}", headers.join(" ")));
    }
    if out.is_empty() {
        "nothing".to_owned()
    } else {
        out.join("; ")
    }
}

fn shorten(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text: String = text.chars().take(48).collect();
    if body.len() > 48 {
        format!("`{text}…`")
    } else {
        format!("`{text}`")
    }
}
