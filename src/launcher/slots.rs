//! Which shared-memory slot a database gets.

use crate::shmem::launch::SlotView;

/// A free slot for `database`: the one that served it before (its counters go on), else one
/// never used, else any free one. `taken[i]`: the launcher serves a database in slot `i`.
pub fn choose(database: u32, views: &[SlotView], taken: &[bool]) -> Option<usize> {
    let free = |i: &usize| !taken[*i] && !views[*i].has_worker();
    let all = 0..views.len().min(taken.len());
    all.clone()
        .filter(free)
        .find(|i| views[*i].database == database)
        .or_else(|| all.clone().filter(free).find(|i| views[*i].database == 0))
        .or_else(|| all.clone().find(free))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(database: u32, pid: i32) -> SlotView {
        SlotView {
            database,
            outbox_pid: pid,
            ..SlotView::default()
        }
    }

    #[test]
    fn a_database_gets_its_old_slot_back_then_an_unused_one_then_any_free_one() {
        let views = [view(10, 0), view(0, 0), view(20, 0)];
        assert_eq!(choose(20, &views, &[false; 3]), Some(2));
        assert_eq!(choose(30, &views, &[false; 3]), Some(1));
        assert_eq!(choose(30, &views, &[false, true, false]), Some(0));
    }

    #[test]
    fn a_slot_with_a_running_worker_or_served_is_never_chosen() {
        let views = [view(10, 77), view(20, 0)];
        assert_eq!(choose(10, &views, &[false, false]), Some(1));
        assert_eq!(choose(10, &views, &[false, true]), None);
    }
}
