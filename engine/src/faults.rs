//! Fault injection for the end-to-end tests: with `amqp_outbox.test_lose_one_in = N`, one first
//! publish in N is handed over marked "lose in transit", to prove that losses are detected and
//! published again; `amqp_outbox.test_delete_after` holds delivered rows back from their DELETE,
//! to prove that a clean shutdown deletes them. Only a build with the `fault-injection` feature
//! has these settings; any other build never loses or holds anything on purpose.

use crate::flight::Flight;
use crate::settings::WorkerSettings;

#[derive(Default)]
pub struct Faults {
    /// First publishes so far.
    #[cfg(feature = "fault-injection")]
    first_publishes: u64,
}

impl Faults {
    /// Applies the settings that change the worker's timing (after every reload).
    #[cfg(feature = "fault-injection")]
    pub fn configure(settings: &WorkerSettings, flight: &mut Flight) {
        flight.set_delete_after(settings.delete_after);
    }

    #[cfg(not(feature = "fault-injection"))]
    pub fn configure(_settings: &WorkerSettings, _flight: &mut Flight) {}

    /// Whether to lose this message in transit.
    #[cfg(feature = "fault-injection")]
    pub fn lose_this_one(&mut self, settings: &WorkerSettings, first_attempt: bool) -> bool {
        let n = u64::from(settings.lose_one_in);
        if n == 0 || !first_attempt {
            return false;
        }
        self.first_publishes += 1;
        self.first_publishes.is_multiple_of(n)
    }

    #[cfg(not(feature = "fault-injection"))]
    pub fn lose_this_one(&mut self, _settings: &WorkerSettings, _first_attempt: bool) -> bool {
        false
    }
}
