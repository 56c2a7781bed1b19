//! One round over a broker's hosts, shared by the publishing connection and the
//! acknowledgement listener: each host in turn (listed or shuffled order) until one connects or
//! the caller is interrupted.

use crate::{BrokerConfig, Endpoint};
use std::future::Future;

/// The hosts of a broker in the order to try them this round.
pub(crate) fn host_order(config: &BrokerConfig) -> Vec<Endpoint> {
    let mut hosts = config.hosts.clone();
    if config.randomize_hosts {
        use rand::seq::SliceRandom;
        hosts.shuffle(&mut rand::thread_rng());
    }
    hosts
}

pub(crate) enum Round<T, I> {
    Connected(Endpoint, T),
    /// Every host failed: one "host: error" each, in the order tried.
    Failed(Vec<String>),
    Interrupted(I),
}

/// A task that can wait on a future while watching for its own interruptions (stop, new
/// configuration).
pub(crate) trait Interruptible {
    type Interrupt;
    fn wait_for<F: Future + Send>(
        &mut self,
        fut: F,
    ) -> impl Future<Output = Result<F::Output, Self::Interrupt>> + Send;
}

/// Tries the hosts of `cfg` with `connect`, each attempt watched by `task`: an interruption
/// ends the round at once.
pub(crate) async fn round<W, T, Fut>(
    task: &mut W,
    cfg: &BrokerConfig,
    connect: impl Fn(Endpoint) -> Fut,
) -> Round<T, W::Interrupt>
where
    W: Interruptible,
    Fut: Future<Output = Result<T, String>> + Send,
{
    let mut errors = Vec::new();
    for ep in host_order(cfg) {
        match task.wait_for(connect(ep.clone())).await {
            Ok(Ok(connection)) => return Round::Connected(ep, connection),
            Ok(Err(e)) => errors.push(format!("{}: {e}", ep.display_name())),
            Err(interrupt) => return Round::Interrupted(interrupt),
        }
    }
    Round::Failed(errors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AckQueueConfig, ProofMode};
    use std::time::Duration;

    fn config(randomize_hosts: bool) -> BrokerConfig {
        let host = |n: u16| Endpoint {
            host: format!("node{n}"),
            port: 5672,
            vhost: "/".into(),
            username: "u".into(),
            password: "p".into(),
            tls: None,
        };
        BrokerConfig {
            broker_id: 1,
            hosts: (1..=8).map(host).collect(),
            randomize_hosts,
            exchanges: vec![],
            queues: vec![],
            bindings: vec![],
            proof: ProofMode::Confirm,
            ack_queue: AckQueueConfig {
                name: "acks".into(),
                quorum: false,
            },
            connect_timeout: Duration::from_secs(1),
            heartbeat_secs: 0,
            confirm_timeout: Duration::from_secs(1),
            reconnect_min: Duration::from_millis(1),
            reconnect_max: Duration::from_millis(2),
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

    /// Attempts are never interrupted here; `stop_at` interrupts the n-th one.
    struct Test {
        attempts: usize,
        stop_at: Option<usize>,
    }

    impl Interruptible for Test {
        type Interrupt = &'static str;
        async fn wait_for<F: Future + Send>(&mut self, fut: F) -> Result<F::Output, &'static str> {
            self.attempts += 1;
            if self.stop_at == Some(self.attempts) {
                return Err("stop");
            }
            Ok(fut.await)
        }
    }

    fn run<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn a_round_stops_at_the_first_host_that_connects_and_names_each_failure() {
        let cfg = config(false);
        let mut task = Test {
            attempts: 0,
            stop_at: None,
        };
        let out = run(round(&mut task, &cfg, |ep: Endpoint| async move {
            if ep.host == "node3" {
                Ok(3)
            } else {
                Err("refused".to_string())
            }
        }));
        assert_eq!(task.attempts, 3);
        assert!(matches!(out, Round::Connected(ep, 3) if ep.host == "node3"));

        let mut task = Test {
            attempts: 0,
            stop_at: None,
        };
        let out = run(round(&mut task, &cfg, |_ep: Endpoint| async move {
            Err::<u16, _>("refused".to_string())
        }));
        match out {
            Round::Failed(errors) => {
                assert_eq!(errors.len(), 8);
                assert!(errors[0].starts_with("u@node1:5672"), "{}", errors[0]);
                assert!(errors[7].ends_with("refused"), "{}", errors[7]);
            }
            _ => panic!("expected every host to fail"),
        }
    }

    #[test]
    fn an_interruption_ends_the_round_at_once() {
        let cfg = config(false);
        let mut task = Test {
            attempts: 0,
            stop_at: Some(2),
        };
        let out = run(round(&mut task, &cfg, |_ep: Endpoint| async move {
            Err::<u16, _>("refused".to_string())
        }));
        assert_eq!(task.attempts, 2);
        assert!(matches!(out, Round::Interrupted("stop")));
    }
}
