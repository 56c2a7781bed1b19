//! A worker's hold on its kind's place in a database slot: its pid, taken only when the place
//! is free and given back only by the process that took it. A twin (started by a launcher that
//! had not seen the first worker yet) finds the place taken and exits.

use std::sync::atomic::{AtomicI32, Ordering};

/// Takes the place for `pid`; `false`: another process holds it.
pub fn take(place: &AtomicI32, pid: i32) -> bool {
    place
        .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}

/// Gives the place back if `pid` holds it; returns whether it did.
pub fn give_back(place: &AtomicI32, pid: i32) -> bool {
    place
        .compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn of_twins_started_at_once_exactly_one_holds_the_place() {
        for _ in 0..200 {
            let place = Arc::new(AtomicI32::new(0));
            let twins: Vec<_> = [101, 202]
                .into_iter()
                .map(|pid| {
                    let place = place.clone();
                    std::thread::spawn(move || take(&place, pid))
                })
                .collect();
            let won: Vec<bool> = twins.into_iter().map(|t| t.join().unwrap()).collect();
            assert_eq!(won.iter().filter(|w| **w).count(), 1, "{won:?}");
            let holder = place.load(Ordering::Acquire);
            let loser = if holder == 101 { 202 } else { 101 };
            // The twin that lost never frees the winner's place.
            assert!(!give_back(&place, loser));
            assert_eq!(place.load(Ordering::Acquire), holder);
            assert!(give_back(&place, holder));
            assert!(take(&place, loser), "free again once given back");
        }
    }
}
