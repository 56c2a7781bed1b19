//! Figures (medians of interleaved repetitions, ratios against the baseline of the same run),
//! the printed table and the JSON file.

use serde_json::{json, Value};

#[derive(Clone, Debug)]
pub enum Target {
    None,
    /// ratio ≥ x
    RatioAtLeast(f64),
    /// ratio > x
    RatioAbove(f64),
    /// ratio < x
    RatioBelow(f64),
    /// median ≤ x (in the figure's unit)
    AtMost(f64),
}

#[derive(Clone, Debug)]
pub struct Figure {
    pub section: String,
    pub name: String,
    pub config: String,
    pub unit: String,
    pub samples: Vec<f64>,
    pub baseline_label: Option<String>,
    pub baseline: Vec<f64>,
    pub target: Target,
    pub note: String,
}

pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// Nearest-rank percentile of integer samples.
pub fn percentile(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64
}

impl Figure {
    pub fn new(section: &str, name: &str, config: &str, unit: &str) -> Figure {
        Figure {
            section: section.to_string(),
            name: name.to_string(),
            config: config.to_string(),
            unit: unit.to_string(),
            samples: Vec::new(),
            baseline_label: None,
            baseline: Vec::new(),
            target: Target::None,
            note: String::new(),
        }
    }

    pub fn samples(mut self, s: Vec<f64>) -> Figure {
        self.samples = s;
        self
    }

    pub fn baseline(mut self, label: &str, s: Vec<f64>) -> Figure {
        self.baseline_label = Some(label.to_string());
        self.baseline = s;
        self
    }

    pub fn target(mut self, t: Target) -> Figure {
        self.target = t;
        self
    }

    pub fn note(mut self, n: impl Into<String>) -> Figure {
        self.note = n.into();
        self
    }

    pub fn median(&self) -> f64 {
        median(&self.samples)
    }

    pub fn baseline_median(&self) -> f64 {
        median(&self.baseline)
    }

    /// Median of the per-repetition ratios when measurement and baseline were interleaved
    /// pairwise (same count), else the ratio of the medians.
    pub fn ratio(&self) -> Option<f64> {
        self.baseline_label.as_ref()?;
        if self.samples.len() == self.baseline.len() && !self.samples.is_empty() {
            let r: Vec<f64> = self
                .samples
                .iter()
                .zip(&self.baseline)
                .map(|(a, b)| a / b)
                .collect();
            Some(median(&r))
        } else {
            Some(self.median() / self.baseline_median())
        }
    }

    pub fn met(&self) -> Option<bool> {
        match self.target {
            Target::None => None,
            Target::RatioAtLeast(x) => self.ratio().map(|r| r >= x),
            Target::RatioAbove(x) => self.ratio().map(|r| r > x),
            Target::RatioBelow(x) => self.ratio().map(|r| r < x),
            Target::AtMost(x) => Some(self.median() <= x),
        }
    }

    pub fn target_text(&self) -> String {
        match self.target {
            Target::None => String::new(),
            Target::RatioAtLeast(x) => format!("ratio ≥ {x}"),
            Target::RatioAbove(x) => format!("ratio > {x}"),
            Target::RatioBelow(x) => format!("ratio < {x}"),
            Target::AtMost(x) => format!("≤ {} {}", fmt_num(x), self.unit),
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "section": self.section,
            "figure": self.name,
            "config": self.config,
            "unit": self.unit,
            "median": finite(self.median()),
            "samples": self.samples,
            "baseline": self.baseline_label,
            "baseline_median": finite(self.baseline_median()),
            "baseline_samples": self.baseline,
            "ratio": self.ratio().and_then(finite),
            "ratio_of_medians": self.baseline_label.as_ref().and_then(|_| finite(self.median() / self.baseline_median())),
            "target": self.target_text(),
            "met": self.met(),
            "note": self.note,
        })
    }
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

pub fn fmt_num(x: f64) -> String {
    if !x.is_finite() {
        return "–".to_string();
    }
    let a = x.abs();
    if a >= 1000.0 {
        let s = format!("{:.0}", x);
        let (sign, digits) = s.split_at(if s.starts_with('-') { 1 } else { 0 });
        let mut out = String::new();
        for (i, ch) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(ch);
        }
        format!("{sign}{out}")
    } else if a >= 100.0 {
        format!("{x:.0}")
    } else if a >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// The markdown table of every figure.
pub fn table(figures: &[Figure]) -> String {
    let mut s = String::from(
        "| # | figure | configuration | median | baseline (median) | ratio | target | met |\n\
         |---|---|---|---:|---|---:|---|---|\n",
    );
    for f in figures {
        let base = match &f.baseline_label {
            Some(l) => format!("{l}: {} {}", fmt_num(f.baseline_median()), f.unit),
            None => String::new(),
        };
        let ratio = f.ratio().map(|r| format!("{r:.2}")).unwrap_or_default();
        let met = match f.met() {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "",
        };
        let note = if f.note.is_empty() {
            String::new()
        } else {
            format!(" ({})", f.note)
        };
        s.push_str(&format!(
            "| {} | {}{} | {} | {} {} | {} | {} | {} | {} |\n",
            f.section,
            f.name,
            note,
            f.config,
            fmt_num(f.median()),
            f.unit,
            base,
            ratio,
            f.target_text(),
            met
        ));
    }
    s
}
