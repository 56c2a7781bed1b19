//! SQL-callable functions. They run in user backends: no threads, no network.

mod admin;
mod publish;
mod status;
