//! The relay's configuration: the databases it serves and the delivery's settings, from a TOML
//! file, then the environment, then the command line (each overriding the one before). The
//! settings carry the extension's names without the `amqp_outbox.` prefix and its defaults
//! ([`amqp_outbox_engine::settings::DEFAULTS`]); times take PostgreSQL's units (`250ms`, `30s`,
//! `5min`, `1h`), a bare number being milliseconds, as the extension's settings are.

use amqp_outbox_engine::settings::{WorkerSettings, DEFAULTS};
use std::time::Duration;

/// The environment variable naming the databases (connection strings separated by whitespace:
/// URLs, `postgresql://…`).
pub const DATABASES_ENV: &str = "AMQP_OUTBOX_RELAY_DATABASES";
/// The environment variable naming the configuration file.
pub const CONFIG_ENV: &str = "AMQP_OUTBOX_RELAY_CONFIG";
/// Every setting `name` may also come from `AMQP_OUTBOX_RELAY_<NAME>` (upper case).
pub const SETTING_ENV_PREFIX: &str = "AMQP_OUTBOX_RELAY_";

/// What the relay runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Connection strings, one per database served.
    pub databases: Vec<String>,
    pub settings: WorkerSettings,
    /// `amqp_outbox.reconcile_window` is not 0: the production log keeps delivered messages.
    pub keep_log: bool,
    /// How often a relay that is not active tries to take a database over.
    pub takeover_every: Duration,
    /// Debug lines are written too.
    pub verbose: bool,
    /// TLS to PostgreSQL (when the connection string's `sslmode` is not `disable`).
    pub postgres_tls: PostgresTls,
    /// A subscription's handler running longer is cancelled and its message failed (zero: no
    /// bound).
    pub handler_timeout: Duration,
    /// Messages handled per transaction by the consuming side, at most.
    pub inbox_batch_size: usize,
}

/// The CA certificates PostgreSQL's certificate is verified against (set: always verified), and
/// the client certificate shown to a verified server ([`crate::tls`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PostgresTls {
    pub ca_file: Option<String>,
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            databases: Vec::new(),
            settings: DEFAULTS.clone(),
            keep_log: true,
            takeover_every: Duration::from_secs(1),
            verbose: false,
            postgres_tls: PostgresTls::default(),
            handler_timeout: Duration::from_secs(30),
            inbox_batch_size: 100,
        }
    }
}

/// What the command line asked for.
#[derive(Debug, PartialEq)]
pub enum Command {
    Run(Box<Config>),
    Help,
    Version,
    /// Print the configuration that would run, and stop.
    Check(Box<Config>),
}

/// The settings a relay takes, with what each means (for `--help` and the documentation).
pub const SETTINGS: &[(&str, &str)] = &[
    ("enabled", "false: publish nothing (rows wait)"),
    ("batch_size", "rows claimed per step"),
    (
        "batch_interval",
        "longest gathering of commits before a claim",
    ),
    ("max_in_flight", "unproven messages per broker"),
    ("max_in_flight_bytes", "unproven body bytes per broker"),
    ("max_attempts", "refusals before a message is parked"),
    ("max_message_size", "larger bodies are parked"),
    ("naptime", "longest sleep without a wake-up"),
    ("resend_after", "no proof within this: published again"),
    ("connect_timeout", "AMQP connection timeout"),
    ("heartbeat", "AMQP heartbeat, seconds"),
    ("confirm_timeout", "longest wait for a publisher confirm"),
    ("retry_backoff_min", "first retry delay"),
    ("retry_backoff_max", "longest retry delay"),
    (
        "ack_queue_quorum",
        "the acknowledgement queue is a quorum queue",
    ),
    ("randomize_hosts", "try a broker's hosts in random order"),
    (
        "reconcile_window",
        "0: keep no production log of delivered messages",
    ),
    (
        "takeover_every",
        "how often a standing-by relay tries to take over",
    ),
    ("handler_timeout", "a subscription handler's longest run"),
    ("inbox_batch_size", "messages handled per transaction"),
];

/// Reads the command line `args` (without the program's name) and the environment `env`.
pub fn parse(args: &[String], env: &dyn Fn(&str) -> Option<String>) -> Result<Command, String> {
    let mut config_file = env(CONFIG_ENV);
    let mut databases = Vec::new();
    let mut sets = Vec::new();
    let mut check = false;
    let mut verbose = false;
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        let mut value = |name: &str| -> Result<String, String> {
            i += 1;
            args.get(i)
                .cloned()
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match arg {
            "-h" | "--help" => return Ok(Command::Help),
            "-V" | "--version" => return Ok(Command::Version),
            "-c" | "--config" => config_file = Some(value(arg)?),
            "-d" | "--database" => databases.push(value(arg)?),
            "-s" | "--set" => sets.push(value(arg)?),
            "--check" => check = true,
            "-v" | "--verbose" => verbose = true,
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
        i += 1;
    }

    let mut config = Config::default();
    if let Some(path) = config_file {
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path}: {e}"))?;
        apply_file(&mut config, &text).map_err(|e| format!("{path}: {e}"))?;
    }
    if let Some(list) = env(DATABASES_ENV) {
        config.databases = list.split_whitespace().map(str::to_owned).collect();
    }
    for (name, _) in SETTINGS {
        if let Some(v) = env(&format!("{SETTING_ENV_PREFIX}{}", name.to_uppercase())) {
            set(&mut config, name, &v)
                .map_err(|e| format!("{SETTING_ENV_PREFIX}{}: {e}", name.to_uppercase()))?;
        }
    }
    if !databases.is_empty() {
        config.databases = databases;
    }
    for s in sets {
        let (name, v) = s
            .split_once('=')
            .ok_or_else(|| format!("--set {s:?}: expected name=value"))?;
        set(&mut config, name.trim(), v.trim()).map_err(|e| format!("--set {name}: {e}"))?;
    }
    config.verbose |= verbose;
    if config.databases.is_empty() {
        return Err(format!(
            "no database to serve: give --database, {DATABASES_ENV} or `databases` in the configuration file"
        ));
    }
    let config = Box::new(config);
    Ok(if check {
        Command::Check(config)
    } else {
        Command::Run(config)
    })
}

/// The file: `databases = [...]`, `verbose = bool` and a `[settings]` table.
fn apply_file(config: &mut Config, text: &str) -> Result<(), String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.to_string())?;
    for (key, value) in &table {
        match (key.as_str(), value) {
            ("databases", toml::Value::Array(list)) => {
                config.databases = list
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_owned)
                            .ok_or_else(|| "databases: a list of strings".to_string())
                    })
                    .collect::<Result<_, _>>()?;
            }
            ("verbose", toml::Value::Boolean(b)) => config.verbose = *b,
            ("settings", toml::Value::Table(settings)) => {
                for (name, v) in settings {
                    let text = match v {
                        toml::Value::String(s) => s.clone(),
                        toml::Value::Integer(i) => i.to_string(),
                        toml::Value::Float(f) => f.to_string(),
                        toml::Value::Boolean(b) => b.to_string(),
                        _ => return Err(format!("settings.{name}: a string, number or boolean")),
                    };
                    set(config, name, &text).map_err(|e| format!("settings.{name}: {e}"))?;
                }
            }
            (other, _) => return Err(format!("unknown or mistyped key {other:?}")),
        }
    }
    Ok(())
}

/// Sets one setting from its text.
fn set(config: &mut Config, name: &str, v: &str) -> Result<(), String> {
    let s = &mut config.settings;
    match name {
        "enabled" => s.enabled = boolean(v)?,
        "batch_size" => s.batch_size = count(v, 1, 1_000_000)?,
        "batch_interval" => s.batch_interval = duration(v, Duration::from_secs(1))?,
        "max_in_flight" => s.max_in_flight = count(v, 1, 1_000_000)?,
        "max_in_flight_bytes" => s.max_in_flight_bytes = count(v, 1024, i32::MAX as usize)?,
        "max_attempts" => s.max_attempts = count(v, 1, i32::MAX as usize)? as i32,
        "max_message_size" => s.max_message_size = count(v, 1, i32::MAX as usize)?,
        "naptime" => s.naptime = at_least(duration(v, Duration::from_secs(3600))?, 10)?,
        "resend_after" => {
            s.resend_after = at_least(duration(v, Duration::from_secs(86_400))?, 100)?
        }
        "connect_timeout" => {
            s.connect_timeout = at_least(duration(v, Duration::from_secs(3600))?, 100)?
        }
        "heartbeat" => s.heartbeat_secs = count(v, 0, u16::MAX as usize)? as u16,
        "confirm_timeout" => {
            s.confirm_timeout = at_least(duration(v, Duration::from_secs(3600))?, 100)?
        }
        "retry_backoff_min" => s.retry_backoff_min = duration(v, Duration::from_secs(3600))?,
        "retry_backoff_max" => s.retry_backoff_max = duration(v, Duration::from_secs(86_400))?,
        "ack_queue_quorum" => s.ack_queue_quorum = boolean(v)?,
        "randomize_hosts" => s.randomize_hosts = boolean(v)?,
        "reconcile_window" => config.keep_log = !duration(v, Duration::MAX)?.is_zero(),
        "takeover_every" => {
            config.takeover_every = at_least(duration(v, Duration::from_secs(3600))?, 100)?
        }
        "handler_timeout" => config.handler_timeout = duration(v, Duration::from_secs(86_400))?,
        "inbox_batch_size" => config.inbox_batch_size = count(v, 1, 10_000)?,
        "postgres_ca_file" => config.postgres_tls.ca_file = path(v),
        "postgres_cert_file" => config.postgres_tls.cert_file = path(v),
        "postgres_key_file" => config.postgres_tls.key_file = path(v),
        _ => return Err(format!("unknown setting {name:?}")),
    }
    s.retry_backoff_max = s.retry_backoff_max.max(s.retry_backoff_min);
    Ok(())
}

/// A file's path; empty: none.
fn path(v: &str) -> Option<String> {
    Some(v.trim().to_owned()).filter(|p| !p.is_empty())
}

fn boolean(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(format!("{v:?} is not a boolean")),
    }
}

fn count(v: &str, min: usize, max: usize) -> Result<usize, String> {
    let n: usize = v
        .trim()
        .parse()
        .map_err(|_| format!("{v:?} is not a whole number"))?;
    if n < min || n > max {
        return Err(format!("{n} is outside {min}..{max}"));
    }
    Ok(n)
}

fn at_least(d: Duration, min_ms: u64) -> Result<Duration, String> {
    if d < Duration::from_millis(min_ms) {
        return Err(format!("{d:?} is below {min_ms}ms"));
    }
    Ok(d)
}

/// A time in PostgreSQL's units (`us`, `ms`, `s`, `min`, `h`, `d`); a bare number is
/// milliseconds. At most `max`.
fn duration(v: &str, max: Duration) -> Result<Duration, String> {
    let t = v.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: f64 = number
        .parse()
        .map_err(|_| format!("{v:?} is not a time (e.g. 250ms, 30s, 5min)"))?;
    let seconds_per = match unit.trim() {
        "us" => 1e-6,
        "" | "ms" => 1e-3,
        "s" => 1.0,
        "min" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        u => {
            return Err(format!(
                "{u:?} is not a unit of time (us, ms, s, min, h, d)"
            ))
        }
    };
    let d = Duration::try_from_secs_f64(n * seconds_per).map_err(|e| format!("{v:?}: {e}"))?;
    if d > max {
        return Err(format!("{v:?} is more than {max:?}"));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    fn run(a: &[&str], env: &[(&str, &str)]) -> Result<Config, String> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        match parse(&args(a), &|k| env.get(k).cloned())? {
            Command::Run(c) => Ok(*c),
            other => Err(format!("{other:?}")),
        }
    }

    #[test]
    fn the_command_line_overrides_the_environment_which_overrides_the_file() {
        let dir = std::env::temp_dir().join(format!("relay-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("relay.toml");
        std::fs::write(
            &file,
            "databases = [\"postgresql://a/x\"]\n[settings]\nbatch_size = 7\nresend_after = \"5s\"\nbatch_interval = 0.5\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let c = run(&["--config", path], &[]).unwrap();
        assert_eq!(c.databases, ["postgresql://a/x"]);
        assert_eq!(c.settings.batch_size, 7);
        assert_eq!(c.settings.resend_after, Duration::from_secs(5));
        assert_eq!(c.settings.batch_interval, Duration::from_micros(500));
        let c = run(
            &["-c", path, "--set", "batch_size=9"],
            &[
                ("AMQP_OUTBOX_RELAY_BATCH_SIZE", "8"),
                (
                    "AMQP_OUTBOX_RELAY_DATABASES",
                    "postgresql://b/y postgresql://c/z",
                ),
            ],
        )
        .unwrap();
        assert_eq!(c.settings.batch_size, 9);
        assert_eq!(c.databases, ["postgresql://b/y", "postgresql://c/z"]);
        let c = run(&["-c", path, "-d", "postgresql://d/w"], &[]).unwrap();
        assert_eq!(c.databases, ["postgresql://d/w"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn defaults_are_the_extensions() {
        let c = run(&["-d", "postgresql://x/y"], &[]).unwrap();
        assert_eq!(c.settings, DEFAULTS);
        assert!(c.keep_log);
    }

    #[test]
    fn bad_input_says_what_is_wrong() {
        let cases: &[(&[&str], &str)] = &[
            (&[], "no database to serve"),
            (&["-d", "x", "--set", "batch_size=0"], "outside"),
            (
                &["-d", "x", "--set", "resend_after=5 fortnights"],
                "not a unit of time",
            ),
            (&["-d", "x", "--set", "nope=1"], "unknown setting"),
            (&["-d", "x", "--set", "enabled"], "expected name=value"),
            (&["-d", "x", "--set", "naptime=1us"], "below"),
            (&["--frobnicate"], "unknown argument"),
            (&["-d"], "needs a value"),
        ];
        for (a, expected) in cases {
            let e = run(a, &[]).unwrap_err();
            assert!(e.contains(expected), "{a:?}: {e}");
        }
        let e = run(&["-d", "x"], &[("AMQP_OUTBOX_RELAY_ENABLED", "perhaps")]).unwrap_err();
        assert!(e.contains("AMQP_OUTBOX_RELAY_ENABLED"), "{e}");
    }

    #[test]
    fn times_take_postgresql_units() {
        let max = Duration::MAX;
        assert_eq!(duration("250", max), Ok(Duration::from_millis(250)));
        assert_eq!(duration("1.5s", max), Ok(Duration::from_millis(1500)));
        assert_eq!(duration("2min", max), Ok(Duration::from_secs(120)));
        assert_eq!(duration("0", max), Ok(Duration::ZERO));
        assert!(duration("-1s", max).is_err());
        assert!(duration("2h", Duration::from_secs(3600)).is_err());
    }
}
