//! Mermaid charts (GitHub renders them in markdown) of what reads better as a picture than as
//! a table: publish cost against the INSERT, drain rates against the raw publisher, latency
//! percentiles. Built from the figures' JSON, so `--charts <results.json>` redraws an old run.

use serde_json::Value;

fn text<'a>(f: &'a Value, key: &str) -> &'a str {
    f.get(key).and_then(Value::as_str).unwrap_or("")
}

fn num(f: &Value, key: &str) -> Option<f64> {
    f.get(key).and_then(Value::as_f64)
}

fn list(values: &[f64], digits: usize) -> String {
    let v: Vec<String> = values.iter().map(|x| format!("{x:.digits$}")).collect();
    format!("[{}]", v.join(", "))
}

fn labels(names: &[String]) -> String {
    let v: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    format!("[{}]", v.join(", "))
}

/// One chart: bars and a line over the same labels.
fn chart(
    title: &str,
    y: &str,
    names: &[String],
    bars: &[f64],
    line: &[f64],
    digits: usize,
) -> String {
    let top = bars
        .iter()
        .chain(line)
        .copied()
        .filter(|x| x.is_finite())
        .fold(0.0_f64, f64::max)
        * 1.15;
    format!(
        "```mermaid\nxychart-beta\n    title \"{title}\"\n    x-axis {}\n    y-axis \"{y}\" 0 --> {top:.digits$}\n    bar {}\n    line {}\n```\n",
        labels(names),
        list(bars, digits),
        list(line, digits),
    )
}

/// Publish cost: `amqp.publish()` ÷ plain INSERT per configuration, worker off (bars) and on
/// (line).
fn publish(figures: &[Value]) -> Option<String> {
    let pick = |name: &str| -> Vec<(String, f64)> {
        figures
            .iter()
            .filter(|f| text(f, "section") == "1 publish cost" && text(f, "figure") == name)
            .filter_map(|f| Some((text(f, "config").replace(", 100 B", ""), num(f, "ratio")?)))
            .collect()
    };
    let off = pick("amqp.publish, worker off / plain INSERT");
    let on = pick("amqp.publish, worker on / plain INSERT");
    if off.is_empty() || off.len() != on.len() {
        return None;
    }
    let names: Vec<String> = off.iter().map(|(c, _)| c.clone()).collect();
    let bars: Vec<f64> = off.iter().map(|(_, r)| *r).collect();
    let line: Vec<f64> = on.iter().map(|(_, r)| *r).collect();
    Some(chart(
        "publish() ÷ plain INSERT (bars: worker off, line: worker on delivering; target 0.97)",
        "ratio",
        &names,
        &bars,
        &line,
        2,
    ))
}

/// A chart of figures' medians (bars) against their baselines' medians (line), one label per
/// figure; none without figures, or when a figure lacks either number.
fn medians_chart<'a>(
    title: &str,
    y: &str,
    digits: usize,
    figures: impl Iterator<Item = &'a Value>,
    label: impl Fn(&Value) -> String,
) -> Option<String> {
    let mut names = Vec::new();
    let mut bars = Vec::new();
    let mut line = Vec::new();
    for f in figures {
        names.push(label(f));
        bars.push(num(f, "median")?);
        line.push(num(f, "baseline_median")?);
    }
    (!names.is_empty()).then(|| chart(title, y, &names, &bars, &line, digits))
}

/// The worker's proof of delivery a figure's name speaks of.
fn mode(figure: &str) -> &'static str {
    if figure.contains("ack_queue") {
        "ack_queue"
    } else {
        "confirm"
    }
}

/// Drain rate of the worker (bars) and of the raw publisher (line), per mode and queue type.
/// Only the worker against the bare raw publisher: the section's other figures have other
/// baselines (the production log off, the raw publisher with the worker's properties).
fn drain(figures: &[Value]) -> Option<String> {
    medians_chart(
        "Drain rate, msg/s (bars: the worker, line: raw lapin publisher)",
        "msg/s",
        0,
        figures.iter().filter(|f| {
            text(f, "section") == "2 drain rate"
                && text(f, "figure").starts_with("worker")
                && text(f, "baseline") == "raw"
        }),
        |f| {
            let queue = if text(f, "config").contains("quorum") {
                "quorum"
            } else {
                "classic"
            };
            format!("{}, {queue}", mode(text(f, "figure")))
        },
    )
}

/// Latency at the lower rate: commit→consumer (bars) against raw publish→consumer (line).
fn latency(figures: &[Value]) -> Option<String> {
    medians_chart(
        "Latency at 200 msg/s, ms (bars: commit→consumer, line: raw publish→consumer)",
        "ms",
        2,
        figures.iter().filter(|f| {
            text(f, "section") == "3 latency"
                && text(f, "config").starts_with("200 msg/s")
                && text(f, "figure").starts_with("commit→consumer")
        }),
        |f| {
            let fig = text(f, "figure");
            let pct = fig
                .split(|c: char| c == ',' || c.is_whitespace())
                .find(|w| w.starts_with('p') || *w == "max")
                .unwrap_or("?");
            format!("{} {pct}", mode(fig))
        },
    )
}

/// Every chart the figures allow, as markdown.
pub fn charts(figures: &[Value]) -> String {
    [publish(figures), drain(figures), latency(figures)]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn drain_and_latency_charts_use_medians_and_baselines() {
        let figures = vec![
            json!({"section": "2 drain rate", "figure": "worker, confirm mode / raw", "config": "100 × 100 B, classic durable queue", "median": 4958.0, "baseline": "raw", "baseline_median": 5085.0}),
            json!({"section": "2 drain rate", "figure": "worker, confirm mode / raw with the worker's properties", "config": "100 × 100 B, classic durable queue", "median": 4958.0, "baseline": "raw, worker's properties", "baseline_median": 6000.0}),
            json!({"section": "2 drain rate", "figure": "raw with the worker's properties / raw", "config": "100 × 100 B, classic durable queue", "median": 6000.0, "baseline": "raw", "baseline_median": 5085.0}),
            json!({"section": "2 drain rate", "figure": "worker, ack_queue mode / raw", "config": "100 × 100 B, quorum queue", "median": 7879.0, "baseline": "raw", "baseline_median": 8704.0}),
            json!({"section": "3 latency", "figure": "commit→consumer p50, ack_queue mode / raw publish→consumer", "config": "200 msg/s, 1 msg/txn", "median": 1.5, "baseline_median": 0.4}),
            json!({"section": "3 latency", "figure": "commit→consumer p50, ack_queue mode / raw publish→consumer", "config": "2000 msg/s, 1 msg/txn", "median": 9.0, "baseline_median": 0.4}),
        ];
        let md = charts(&figures);
        assert!(
            md.contains("x-axis [\"confirm, classic\", \"ack_queue, quorum\"]"),
            "{md}"
        );
        assert!(md.contains("bar [4958, 7879]"), "{md}");
        assert!(md.contains("line [5085, 8704]"), "{md}");
        assert!(md.contains("x-axis [\"ack_queue p50\"]"), "{md}");
        assert!(md.contains("bar [1.50]"), "{md}");
        assert!(
            !md.contains("publish() ÷"),
            "no publish figures, no publish chart: {md}"
        );
    }
}
