//! Unit tests of the state machine, the MVCC store and the watch hub.

mod alarms;
mod auth_apply;
mod auth_tokens;
mod backups;
mod durable_state;
mod helpers;
mod kv_semantics;
mod member_records;
mod mvcc_semantics;
mod range_view;
mod snapshot_determinism;
mod snapshot_source;
mod snapshot_stream;
mod txn_bounds;
mod watch_semantics;
