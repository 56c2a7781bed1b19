//! End-to-end test harness (filled in by the e2e work).
