//! A row of `amqp.message` as a claim read it.

/// One claimed row of `amqp.message`.
pub struct Row {
    pub id: i64,
    pub message_id: String,
    pub broker_id: i32,
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub delivery_mode: i16,
    pub content_type: Option<String>,
    pub reply_to: Option<String>,
    pub correlation_id: Option<String>,
    /// As the text of the jsonb value: parsed by the worker, which parks a row whose headers
    /// cannot be sent instead of failing the whole claim.
    pub headers: Option<String>,
    pub producer_pid: i32,
    /// Unix microseconds.
    pub producer_started_at: i64,
    /// Unix microseconds.
    pub created_at: i64,
    pub attempts: i32,
    pub tags: RowTags,
    /// The transaction that wrote the row as it was read (its `xmin`; 0 when unknown): what a
    /// message waits for when `amqp_outbox.standby_names` is set.
    pub writer: u32,
}

/// A row's reconciliation tags as stored (`None`: the default applies).
#[derive(Default, Debug, Clone)]
pub struct RowTags {
    pub business_type: Option<String>,
    pub business_key: Option<String>,
    pub traceparent: Option<String>,
    pub system_id: Option<String>,
    pub host_id: Option<String>,
}
