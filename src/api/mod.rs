//! SQL-callable functions. They run in user backends: no threads, no network.

mod admin;
mod known_brokers;
mod parked;
mod publish;
mod status;
mod topology;
