//! The one reconnect driver. Every long-lived AMQP client of a broker (the publishing
//! connection, the acknowledgement listener, and any consumer to come) is a [`Client`] that
//! [`drive`] keeps connected: a round over the broker's hosts (listed or shuffled order) until
//! one connects, the client's use of that connection until it ends, and between failed rounds
//! the product's one backoff. Every wait is interruptible by the client (stop, new
//! configuration).

use crate::backoff::Backoff;
use crate::config::{BrokerConfig, Endpoint};
use futures_util::future::BoxFuture;
use std::future::Future;
use std::time::Duration;

/// Why a client's wait was cut short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Interrupt {
    Stop,
    /// Connect again at once: reconnect requested, or a configuration that needs a new
    /// connection. The backoff starts over.
    Restart,
}

/// How a client's use of a connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End {
    Stop,
    /// Connect again at once.
    Restart,
    /// The connection was lost: connect again after the shortest delay.
    Lost,
    /// The broker kept refusing on it: connect again after a delay that grows while this
    /// repeats.
    Refused,
}

/// A long-lived client of one broker, kept connected by [`drive`].
pub(crate) trait Client: Send {
    /// What a successful connection attempt hands to [`Client::serve`].
    type Conn: Send + 'static;

    fn config(&self) -> &BrokerConfig;

    /// Connects to one host and prepares the connection for use, bounded by the connect
    /// timeout. The future owns what it needs, so the client can watch for interruptions
    /// meanwhile.
    fn connect(&self, ep: Endpoint) -> BoxFuture<'static, Result<Self::Conn, String>>;

    /// Awaits `fut` unless the client is interrupted first.
    fn wait_for<F: Future + Send>(
        &mut self,
        fut: F,
    ) -> impl Future<Output = Result<F::Output, Interrupt>> + Send;

    /// Uses the connection until it ends.
    fn serve(&mut self, ep: Endpoint, conn: Self::Conn) -> impl Future<Output = End> + Send;

    /// Every host failed this round: one "user@host:port/vhost: error" each, in the order
    /// tried.
    fn unreachable(&mut self, errors: Vec<String>);

    /// The broker has no host at all; the driver waits for a new configuration.
    fn no_hosts(&mut self) {}
}

/// The hosts of a broker in the order to try them this round.
pub(crate) fn host_order(config: &BrokerConfig) -> Vec<Endpoint> {
    let mut hosts = config.hosts.clone();
    if config.randomize_hosts {
        use rand::seq::SliceRandom;
        hosts.shuffle(&mut rand::thread_rng());
    }
    hosts
}

/// Keeps `client` connected until it stops.
pub(crate) async fn drive<C: Client>(client: &mut C) {
    // Rounds in a row in which no host connected, and connections in a row given up because
    // the broker kept refusing: each drives its own backoff.
    let mut failures: u32 = 0;
    let mut refused_in_a_row: u32 = 0;
    let mut delay: Option<Duration> = None;
    loop {
        if let Some(d) = delay.take() {
            match client.wait_for(tokio::time::sleep(d)).await {
                Ok(()) => {}
                Err(Interrupt::Restart) => failures = 0,
                Err(Interrupt::Stop) => return,
            }
        }
        if client.config().hosts.is_empty() {
            client.no_hosts();
            match client.wait_for(std::future::pending::<()>()).await {
                Err(Interrupt::Stop) => return,
                _ => {
                    failures = 0;
                    continue;
                }
            }
        }
        let backoff = {
            let cfg = client.config();
            Backoff::new(cfg.reconnect_min, cfg.reconnect_max)
        };
        let (ep, conn) = match round(client).await {
            Round::Connected(ep, conn) => (ep, conn),
            Round::Interrupted(Interrupt::Stop) => return,
            Round::Interrupted(Interrupt::Restart) => {
                failures = 0;
                continue;
            }
            Round::Failed(errors) => {
                client.unreachable(errors);
                delay = Some(backoff.delay(failures));
                failures = failures.saturating_add(1);
                continue;
            }
        };
        failures = 0;
        match client.serve(ep, conn).await {
            End::Stop => return,
            End::Restart => {}
            End::Lost => {
                refused_in_a_row = 0;
                delay = Some(backoff.delay(0));
            }
            End::Refused => {
                delay = Some(backoff.delay(refused_in_a_row));
                refused_in_a_row = refused_in_a_row.saturating_add(1);
            }
        }
    }
}

enum Round<T> {
    Connected(Endpoint, T),
    Failed(Vec<String>),
    Interrupted(Interrupt),
}

/// Tries each host in turn until one connects; an interruption ends the round at once.
async fn round<C: Client>(client: &mut C) -> Round<C::Conn> {
    let mut errors = Vec::new();
    for ep in host_order(client.config()) {
        let attempt = client.connect(ep.clone());
        match client.wait_for(attempt).await {
            Ok(Ok(conn)) => return Round::Connected(ep, conn),
            Ok(Err(e)) => errors.push(format!("{}: {e}", ep.display_name())),
            Err(interrupt) => return Round::Interrupted(interrupt),
        }
    }
    Round::Failed(errors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::fixtures::{broker_config, endpoint};
    use futures_util::future::FutureExt;

    fn config(randomize_hosts: bool) -> BrokerConfig {
        let hosts = (1..=8)
            .map(|n| endpoint(&format!("node{n}"), "p"))
            .collect();
        BrokerConfig {
            randomize_hosts,
            ..broker_config(hosts)
        }
    }

    #[test]
    fn hosts_are_tried_in_listed_order_unless_randomized() {
        let listed = config(false);
        assert_eq!(host_order(&listed), listed.hosts);
        let random = config(true);
        let mut seen_other_order = false;
        for _ in 0..50 {
            let order = host_order(&random);
            let mut sorted = order.clone();
            sorted.sort_by(|a, b| a.host.cmp(&b.host));
            assert_eq!(sorted, random.hosts, "a permutation of the same hosts");
            seen_other_order |= order != random.hosts;
        }
        assert!(
            seen_other_order,
            "50 shuffles of 8 hosts all kept the listed order"
        );
    }

    /// A client whose attempts connect at `connects_on` hosts (by name), whose connections end
    /// as `ends` says in turn, and that stops when `ends` runs out. `interrupt_at` interrupts the
    /// n-th wait. Everything it sees is written to `log`.
    struct Script {
        cfg: BrokerConfig,
        connects_on: Vec<&'static str>,
        ends: Vec<End>,
        waits: usize,
        interrupt_at: Option<(usize, Interrupt)>,
        log: Vec<String>,
    }

    impl Client for Script {
        type Conn = String;
        fn config(&self) -> &BrokerConfig {
            &self.cfg
        }
        fn connect(&self, ep: Endpoint) -> BoxFuture<'static, Result<String, String>> {
            let ok = self.connects_on.contains(&ep.host.as_str());
            async move {
                if ok {
                    Ok(ep.host)
                } else {
                    Err("refused".to_string())
                }
            }
            .boxed()
        }
        async fn wait_for<F: Future + Send>(&mut self, fut: F) -> Result<F::Output, Interrupt> {
            self.waits += 1;
            if let Some((n, i)) = self.interrupt_at {
                if n == self.waits {
                    self.log.push(format!("interrupted {i:?}"));
                    return Err(i);
                }
            }
            Ok(fut.await)
        }
        async fn serve(&mut self, _ep: Endpoint, conn: String) -> End {
            self.log.push(format!("serve {conn}"));
            if self.ends.is_empty() {
                End::Stop
            } else {
                self.ends.remove(0)
            }
        }
        fn unreachable(&mut self, errors: Vec<String>) {
            self.log.push(format!("unreachable {}", errors.len()));
        }
        fn no_hosts(&mut self) {
            self.log.push("no hosts".into());
        }
    }

    fn script(connects_on: Vec<&'static str>, ends: Vec<End>) -> Script {
        Script {
            cfg: config(false),
            connects_on,
            ends,
            waits: 0,
            interrupt_at: None,
            log: vec![],
        }
    }

    fn run<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn a_round_stops_at_the_first_host_that_connects() {
        let mut c = script(vec!["node3"], vec![]);
        run(drive(&mut c));
        assert_eq!(c.log, vec!["serve node3"]);
        assert_eq!(c.waits, 3, "node1, node2 refused, node3 connected");
    }

    #[test]
    fn failed_rounds_name_every_host_and_back_off_until_one_connects() {
        let mut c = script(vec![], vec![]);
        // Rounds of 8 attempts and a backoff sleep between them; the 20th wait stops it.
        c.interrupt_at = Some((20, Interrupt::Stop));
        run(drive(&mut c));
        assert_eq!(
            c.log,
            vec!["unreachable 8", "unreachable 8", "interrupted Stop"]
        );
    }

    #[test]
    fn lost_and_refused_connections_reconnect_and_restart_does_at_once() {
        let mut c = script(vec!["node1"], vec![End::Lost, End::Refused, End::Restart]);
        run(drive(&mut c));
        assert_eq!(
            c.log,
            vec!["serve node1", "serve node1", "serve node1", "serve node1"]
        );
        // Lost and Refused sleep before reconnecting (one wait each), Restart does not.
        assert_eq!(c.waits, 4 + 2);
    }

    #[test]
    fn an_interruption_ends_the_round_at_once() {
        let mut c = script(vec![], vec![]);
        c.interrupt_at = Some((2, Interrupt::Stop));
        run(drive(&mut c));
        assert_eq!(c.log, vec!["interrupted Stop"]);
        assert_eq!(c.waits, 2);
    }

    #[test]
    fn without_hosts_it_waits_for_a_configuration() {
        let mut c = script(vec![], vec![]);
        c.cfg.hosts.clear();
        c.interrupt_at = Some((1, Interrupt::Stop));
        run(drive(&mut c));
        assert_eq!(c.log, vec!["no hosts", "interrupted Stop"]);
    }
}
