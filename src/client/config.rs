//! The outbound layer's settings as each call reads them.

use std::time::Duration;

use http::HeaderName;

use super::retry::RetryStatuses;
use crate::key::Purpose;

/// What an [`IdempotentClientLayer`](super::IdempotentClientLayer) was built with, shared by
/// every client it makes.
#[derive(Clone, Debug)]
pub(crate) struct ClientConfig {
    pub(crate) purpose: Purpose,
    pub(crate) header: HeaderName,
    pub(crate) max_attempts: u32,
    pub(crate) attempt_timeout: Duration,
    pub(crate) deadline: Duration,
    pub(crate) base_delay: Duration,
    pub(crate) max_delay: Duration,
    pub(crate) max_body: usize,
    pub(crate) retry_statuses: RetryStatuses,
}
