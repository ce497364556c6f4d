//! Backend configuration: device, deadlines, the path policies (`policy`)
//! and the tuner's settings, scratch size, diagnostics; with the
//! `METRALE_COMM_*` environment overrides documented in
//! `docs/operations.md`.
//!
//! Invariants: the default collective timeout lies inside 10-300 s; a
//! configuration is refused below the floors `validate` states
//! ([`MIN_TIMEOUT`], [`MIN_SCRATCH_BYTES`], a fast-path range some payload
//! can take).

use std::path::PathBuf;
use std::time::Duration;

use crate::error::CommError;
use crate::timing::Trials;

mod policy;
pub use policy::{
    AUTO_FAST_PATH_MAX_BYTES, AUTO_ONE_SHOT_MAX_BYTES, FastPathPolicy, OneShotPolicy, parse_bytes,
};

/// The default collective timeout.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(60);
/// The default communicator-init timeout.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(120);
/// The shortest timeout a configuration accepts: below it no collective,
/// init or drain can be told apart from a hang.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(100);
/// The smallest fast-path scratch capacity a configuration accepts: a
/// smaller buffer would cut a fast-path all-reduce into so many chunks that
/// it costs more than NCCL's.
pub const MIN_SCRATCH_BYTES: usize = 64 << 10;
/// The largest `MIN` of a `MIN-MAX` fast-path range: above it NCCL's
/// all-reduce runs at bus bandwidth and the add kernel's extra pass over
/// memory only loses, so such a range is a mistake (often a unit typo).
pub const MAX_FAST_PATH_MIN_BYTES: usize = 1 << 30;

/// Where the tuner keeps its tables between starts (`METRALE_COMM_TUNE_CACHE`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TuneCache {
    /// `$XDG_CACHE_HOME/metrale-comm`, else `$HOME/.cache/metrale-comm`
    /// (none when neither is set).
    #[default]
    Default,
    /// This directory.
    Dir(PathBuf),
    /// No cache: every start times the paths.
    Off,
}

/// How the backend's communicator hands work to NCCL. Both modes init with
/// a deadline (non-blocking init, polled) and watch every submission's
/// completion; they differ in the enqueue call itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum EnqueueMode {
    /// A non-blocking communicator: every NCCL call returns at once and is
    /// polled with a deadline, including connection set-up at a peer's
    /// first operation. NCCL starts a thread for every call on such a
    /// communicator, tens of microseconds per eager operation
    /// (docs/decisions/0001-blocking-communicators-by-default.md); work
    /// replayed from a CUDA graph does not pay it. For engines that want no NCCL call to block the calling thread
    /// at all, at that price.
    NonBlocking,
    /// A blocking communicator, joined once the non-blocking init has
    /// succeeded (rank 0's fresh unique id is broadcast over the
    /// non-blocking communicator, which every rank then destroys before
    /// joining a blocking one with the id, within the init timeout;
    /// `nccl_safe::Comm::into_blocking`): NCCL enqueues on the calling
    /// thread, as raw NCCL does. A call that stays inside NCCL
    /// (connection set-up waiting for a peer that never issues its side) is
    /// caught by the watchdog at the collective timeout, which poisons the
    /// backend and aborts the communicator to release it. The default:
    /// construction costs a second communicator init, and every eager
    /// operation costs what raw NCCL's does plus the backend's own few
    /// microseconds (`docs/benchmarks.md`).
    #[default]
    Blocking,
}

impl EnqueueMode {
    /// Parses `blocking` or `nonblocking` (also `non-blocking`).
    pub fn parse(s: &str) -> Result<Self, CommError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "blocking" => Ok(EnqueueMode::Blocking),
            "nonblocking" | "non-blocking" => Ok(EnqueueMode::NonBlocking),
            other => Err(CommError::Config(format!(
                "enqueue mode `{other}`: expected blocking or nonblocking"
            ))),
        }
    }
}

/// How a [`crate::NcclBackend`] is built and behaves.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BackendConfig {
    /// CUDA device ordinal of this rank.
    pub device: usize,
    /// How long any submitted operation may take before the communicator is
    /// poisoned and aborted. Also the deadline of host waits.
    pub collective_timeout: Duration,
    /// How long communicator init (and the rendezvous) may take.
    pub init_timeout: Duration,
    /// How long `shutdown` waits for enqueued work before aborting.
    pub shutdown_timeout: Duration,
    /// The 2-rank fast-path policy.
    pub fast_path: FastPathPolicy,
    /// The one-shot policy (2 to 8 ranks; `METRALE_COMM_ONE_SHOT`). It is
    /// consulted before the fast path's. Must be the same on every rank.
    pub one_shot: OneShotPolicy,
    /// Whether the `Auto` policies are tuned at set-up (`METRALE_COMM_TUNE`,
    /// `on` or `off`); with tuning off they are `Never`: NCCL's all-reduce
    /// only, unless a policy names a range.
    pub tune: bool,
    /// Where tuned tables are kept between starts.
    pub tune_cache: TuneCache,
    /// The tuner's trials for every size (`METRALE_COMM_TUNE_TRIALS`,
    /// `TRIALSxCALLS`, `1x1` and up); `None`, the default, takes
    /// [`Trials::for_bytes`]. Fewer trials make the set-up shorter and the
    /// figures noisier; where the times are exact (the emulator's cost
    /// model) one call suffices. Part of the settings every rank must share.
    pub tune_trials: Option<Trials>,
    /// Whether the fused one-shot all-reduce + add + RMSNorm spreads a row
    /// over a thread block cluster where the device can (compute capability
    /// 9.0 and newer; `METRALE_COMM_FUSED_CLUSTER`, `on` or `off`; default
    /// off: on one H200 it measured within the noise of one block a row,
    /// docs/benchmarks.md). Off, or on older devices, one block takes a
    /// row. Both give the same bits, so ranks may differ in it.
    pub fused_cluster: bool,
    /// Capacity of the fast path's receive buffer; larger payloads go in
    /// chunks of this size. A 2-rank backend whose policy can take the fast
    /// path allocates `min(scratch_bytes, largest fast-path payload)` of
    /// device memory once, at construction (never under graph capture).
    pub scratch_bytes: usize,
    /// Entries kept by the flight recorder.
    pub flight_recorder_capacity: usize,
    /// Where flight-recorder dumps go on a failure (`None`: no dump).
    pub dump_dir: Option<PathBuf>,
    /// How often the watchdog polls completion events and NCCL's
    /// asynchronous error.
    pub watchdog_interval: Duration,
    /// How the communicator enqueues work (see [`EnqueueMode`]).
    pub enqueue: EnqueueMode,
    /// Whether the `METRALE_COMM_*` environment overrides apply when a
    /// backend is built from this configuration (every entry point applies
    /// them the same way; see [`BackendConfig::with_env_overrides`]).
    pub env_overrides: bool,
}

impl BackendConfig {
    /// The defaults for `device`.
    pub fn new(device: usize) -> Self {
        Self {
            device,
            collective_timeout: DEFAULT_COLLECTIVE_TIMEOUT,
            init_timeout: DEFAULT_INIT_TIMEOUT,
            shutdown_timeout: Duration::from_secs(10),
            fast_path: FastPathPolicy::Auto,
            one_shot: OneShotPolicy::Auto,
            tune: true,
            tune_cache: TuneCache::Default,
            tune_trials: None,
            fused_cluster: false,
            scratch_bytes: 32 << 20,
            flight_recorder_capacity: 4096,
            dump_dir: None,
            watchdog_interval: Duration::from_millis(2),
            enqueue: EnqueueMode::default(),
            env_overrides: true,
        }
    }

    /// This configuration exactly: the `METRALE_COMM_*` environment does
    /// not override it when a backend is built (for code that pins a value
    /// an operator must not change).
    pub fn without_env_overrides(mut self) -> Self {
        self.env_overrides = false;
        self
    }

    /// Sets the enqueue mode.
    pub fn with_enqueue(mut self, mode: EnqueueMode) -> Self {
        self.enqueue = mode;
        self
    }

    /// Sets the collective timeout.
    pub fn with_collective_timeout(mut self, t: Duration) -> Self {
        self.collective_timeout = t;
        self
    }

    /// Sets the init timeout.
    pub fn with_init_timeout(mut self, t: Duration) -> Self {
        self.init_timeout = t;
        self
    }

    /// Sets the fast-path policy.
    pub fn with_fast_path(mut self, p: FastPathPolicy) -> Self {
        self.fast_path = p;
        self
    }

    /// Sets whether the fused kernel spreads a row over a thread block
    /// cluster where the device can ([`BackendConfig::fused_cluster`]).
    pub fn with_fused_cluster(mut self, on: bool) -> Self {
        self.fused_cluster = on;
        self
    }

    /// Sets the one-shot policy.
    pub fn with_one_shot(mut self, p: OneShotPolicy) -> Self {
        self.one_shot = p;
        self
    }

    /// Turns the tuner on or off (see [`BackendConfig::tune`]).
    pub fn with_tune(mut self, on: bool) -> Self {
        self.tune = on;
        self
    }

    /// Sets the tuner's trials for every size (see
    /// [`BackendConfig::tune_trials`]).
    pub fn with_tune_trials(mut self, trials: Trials) -> Self {
        self.tune_trials = Some(trials);
        self
    }

    /// Sets where tuned tables are kept.
    pub fn with_tune_cache(mut self, cache: TuneCache) -> Self {
        self.tune_cache = cache;
        self
    }

    /// This configuration with the `Auto` policies resolved where tuning
    /// is off: `Never`, so that nothing is set up for a path the tuner
    /// will not choose.
    pub fn with_tuning_resolved(mut self) -> Self {
        if !self.tune {
            if self.one_shot == OneShotPolicy::Auto {
                self.one_shot = OneShotPolicy::Never;
            }
            if self.fast_path == FastPathPolicy::Auto {
                self.fast_path = FastPathPolicy::Never;
            }
        }
        self
    }

    /// Sets the scratch capacity.
    pub fn with_scratch_bytes(mut self, bytes: usize) -> Self {
        self.scratch_bytes = bytes;
        self
    }

    /// Sets the dump directory.
    pub fn with_dump_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dump_dir = Some(dir.into());
        self
    }

    /// Checks every value against its documented bounds: timeouts at least
    /// [`MIN_TIMEOUT`], the scratch capacity at least [`MIN_SCRATCH_BYTES`]
    /// and whole bf16 elements, a fast-path range that can be meant, and a
    /// non-empty flight recorder. `NcclBackend::new` calls it.
    pub fn validate(&self) -> Result<(), CommError> {
        for (name, t) in [
            ("collective timeout", self.collective_timeout),
            ("init timeout", self.init_timeout),
            ("shutdown timeout", self.shutdown_timeout),
        ] {
            if t < MIN_TIMEOUT {
                return Err(CommError::Config(format!(
                    "the {name} of {t:?} is below the floor of {MIN_TIMEOUT:?}"
                )));
            }
        }
        if self.scratch_bytes < MIN_SCRATCH_BYTES || !self.scratch_bytes.is_multiple_of(2) {
            return Err(CommError::Config(format!(
                "the fast path's scratch capacity of {} bytes must be whole bf16 elements \
                 and at least {MIN_SCRATCH_BYTES} bytes",
                self.scratch_bytes
            )));
        }
        self.fast_path
            .validate()
            .map_err(|why| CommError::Config(format!("fast path policy: {why}")))?;
        self.one_shot
            .validate()
            .map_err(|why| CommError::Config(format!("one-shot policy: {why}")))?;
        if self.flight_recorder_capacity == 0 {
            return Err(CommError::Config(
                "the flight recorder needs at least one entry".into(),
            ));
        }
        let in_bounds = |n: usize| (1..=MAX_TUNE_TRIALS).contains(&n);
        if let Some(t) = self.tune_trials
            && !(in_bounds(t.trials) && in_bounds(t.calls))
        {
            return Err(CommError::Config(format!(
                "the tuner's trials ({} of {} calls) must each be 1 to {MAX_TUNE_TRIALS}",
                t.trials, t.calls
            )));
        }
        if self.watchdog_interval.is_zero() || self.watchdog_interval > Duration::from_secs(1) {
            return Err(CommError::Config(format!(
                "the watchdog interval of {:?} must be in (0, 1 s]",
                self.watchdog_interval
            )));
        }
        Ok(())
    }

    /// Applies the `METRALE_COMM_*` environment overrides (a no-op after
    /// [`BackendConfig::without_env_overrides`]). Every way of building an
    /// `NcclBackend` applies them, on top of the configuration it is given:
    /// the precedence is defaults, then the code's configuration, then the
    /// environment (`METRALE_COMM_DEVICE` for the device, over the
    /// launcher's local rank).
    pub fn with_env_overrides(self) -> Result<Self, CommError> {
        if !self.env_overrides {
            return Ok(self);
        }
        self.with_overrides(|k| std::env::var(k).ok())
    }

    /// Applies overrides from `get` (the environment in
    /// [`BackendConfig::with_env_overrides`]; a map in tests).
    pub fn with_overrides(
        mut self,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, CommError> {
        let secs = |name: &str| -> Result<Option<Duration>, CommError> {
            let Some(v) = get(name) else { return Ok(None) };
            let s: f64 = v.trim().parse().map_err(|_| {
                CommError::Config(format!("{name}=`{v}` is not a number of seconds"))
            })?;
            if !(s >= MIN_TIMEOUT.as_secs_f64() && s <= 86_400.0) {
                return Err(CommError::Config(format!(
                    "{name}=`{v}` must be in [{}, 86400] seconds",
                    MIN_TIMEOUT.as_secs_f64()
                )));
            }
            Ok(Some(Duration::from_secs_f64(s)))
        };
        if let Some(t) = secs("METRALE_COMM_TIMEOUT_SECS")? {
            self.collective_timeout = t;
        }
        if let Some(t) = secs("METRALE_COMM_INIT_TIMEOUT_SECS")? {
            self.init_timeout = t;
        }
        if let Some(t) = secs("METRALE_COMM_SHUTDOWN_TIMEOUT_SECS")? {
            self.shutdown_timeout = t;
        }
        if let Some(p) = get("METRALE_COMM_FAST_PATH") {
            self.fast_path = FastPathPolicy::parse(&p)?;
        }
        if let Some(p) = get("METRALE_COMM_ONE_SHOT") {
            self.one_shot = OneShotPolicy::parse(&p)?;
        }
        if let Some(t) = get("METRALE_COMM_TUNE") {
            self.tune = match t.trim().to_ascii_lowercase().as_str() {
                "on" | "1" | "auto" => true,
                "off" | "0" | "never" => false,
                _ => {
                    return Err(CommError::Config(format!(
                        "METRALE_COMM_TUNE=`{t}`: expected on or off"
                    )));
                }
            };
        }
        if let Some(t) = get("METRALE_COMM_FUSED_CLUSTER") {
            self.fused_cluster = match t.trim().to_ascii_lowercase().as_str() {
                "on" | "1" | "auto" => true,
                "off" | "0" | "never" => false,
                _ => {
                    return Err(CommError::Config(format!(
                        "METRALE_COMM_FUSED_CLUSTER=`{t}`: expected on or off"
                    )));
                }
            };
        }
        if let Some(c) = get("METRALE_COMM_TUNE_CACHE") {
            self.tune_cache = match c.trim() {
                "" => TuneCache::Default,
                "off" | "none" => TuneCache::Off,
                dir => TuneCache::Dir(PathBuf::from(dir)),
            };
        }
        if let Some(t) = get("METRALE_COMM_TUNE_TRIALS") {
            self.tune_trials = parse_trials(&t)?;
        }
        if let Some(b) = get("METRALE_COMM_SCRATCH_BYTES") {
            self.scratch_bytes = parse_bytes(&b)?;
        }
        if let Some(m) = get("METRALE_COMM_ENQUEUE") {
            self.enqueue = EnqueueMode::parse(&m)?;
        }
        if let Some(d) = get("METRALE_COMM_DEVICE").filter(|d| !d.trim().is_empty()) {
            self.device = d.trim().parse().map_err(|_| {
                CommError::Config(format!("METRALE_COMM_DEVICE=`{d}` is not a device index"))
            })?;
        }
        if let Some(d) = get("METRALE_COMM_DUMP_DIR").filter(|d| !d.is_empty()) {
            self.dump_dir = Some(PathBuf::from(d));
        }
        if let Some(n) = get("METRALE_COMM_FLIGHT_RECORDER_ENTRIES") {
            self.flight_recorder_capacity =
                n.trim().parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    CommError::Config(format!("METRALE_COMM_FLIGHT_RECORDER_ENTRIES=`{n}`"))
                })?;
        }
        self.validate()?;
        Ok(self)
    }
}

/// The most trials, and calls per trial, [`BackendConfig::tune_trials`]
/// takes.
pub const MAX_TUNE_TRIALS: usize = 1000;

/// `METRALE_COMM_TUNE_TRIALS`: `TRIALSxCALLS` (`5x16`), or empty for the
/// default ladder. The bounds are [`BackendConfig::validate`]'s.
fn parse_trials(v: &str) -> Result<Option<Trials>, CommError> {
    let v = v.trim();
    if v.is_empty() {
        return Ok(None);
    }
    let bad = || {
        CommError::Config(format!(
            "METRALE_COMM_TUNE_TRIALS=`{v}`: expected TRIALSxCALLS (5x16), each 1 to {MAX_TUNE_TRIALS}"
        ))
    };
    let (t, c) = v.split_once(['x', 'X']).ok_or_else(bad)?;
    let num = |n: &str| {
        n.trim()
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_TUNE_TRIALS).contains(n))
    };
    match (num(t), num(c)) {
        (Some(trials), Some(calls)) => Ok(Some(Trials { trials, calls })),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn default_timeout_is_within_10_to_300_seconds() {
        let c = BackendConfig::new(0);
        assert!(c.collective_timeout >= Duration::from_secs(10));
        assert!(c.collective_timeout <= Duration::from_secs(300));
    }

    #[test]
    fn policies_parse() {
        assert_eq!(
            FastPathPolicy::parse("never").unwrap(),
            FastPathPolicy::Never
        );
        assert_eq!(
            FastPathPolicy::parse("always").unwrap(),
            FastPathPolicy::Always
        );
        assert_eq!(FastPathPolicy::parse("auto").unwrap(), FastPathPolicy::Auto);
        assert!(!FastPathPolicy::Auto.takes_fast_path(2 << 20));
        assert_eq!(
            FastPathPolicy::Auto.max_fast_bytes(),
            Some(AUTO_FAST_PATH_MAX_BYTES)
        );
        assert_eq!(
            FastPathPolicy::parse("256K-32M").unwrap(),
            FastPathPolicy::Range {
                min_bytes: 256 << 10,
                max_bytes: 32 << 20
            }
        );
        assert!(FastPathPolicy::parse("32M-1K").is_err());
        assert!(FastPathPolicy::parse("fast").is_err());
        assert!(parse_bytes("99999999999999999999G").is_err());
    }

    #[test]
    fn one_shot_policies_parse() {
        assert_eq!(OneShotPolicy::parse("off").unwrap(), OneShotPolicy::Never);
        assert_eq!(
            OneShotPolicy::parse("always").unwrap(),
            OneShotPolicy::Always
        );
        assert_eq!(OneShotPolicy::parse(" Auto ").unwrap(), OneShotPolicy::Auto);
        assert_eq!(
            OneShotPolicy::parse("8K-512K").unwrap(),
            OneShotPolicy::Range {
                min_bytes: 8 << 10,
                max_bytes: 512 << 10
            }
        );
        assert!(!OneShotPolicy::Auto.takes(2), "the tuned table decides");
        assert_eq!(
            OneShotPolicy::Auto.max_bytes(),
            Some(AUTO_ONE_SHOT_MAX_BYTES)
        );
        for bad in ["1M-1K", "0-1", "fast", "1M"] {
            assert!(OneShotPolicy::parse(bad).is_err(), "{bad}");
        }
        let c = BackendConfig::new(0)
            .with_overrides(|k| (k == "METRALE_COMM_ONE_SHOT").then(|| "never".to_string()))
            .unwrap();
        assert_eq!(c.one_shot, OneShotPolicy::Never);
        assert_eq!(BackendConfig::new(0).one_shot, OneShotPolicy::Auto);
        assert_eq!(BackendConfig::new(0).fast_path, FastPathPolicy::Auto);
        let r = BackendConfig::new(0)
            .with_overrides(|k| (k == "METRALE_COMM_ONE_SHOT").then(|| "2-1".to_string()));
        assert!(matches!(r, Err(CommError::Config(m)) if m.contains("MIN > MAX")));
    }

    #[test]
    fn env_overrides_apply_and_reject_garbage() {
        let env: HashMap<&str, &str> = [
            ("METRALE_COMM_TIMEOUT_SECS", "2.5"),
            ("METRALE_COMM_FAST_PATH", "never"),
            ("METRALE_COMM_SCRATCH_BYTES", "8M"),
            ("METRALE_COMM_DUMP_DIR", "/tmp/fr"),
            ("METRALE_COMM_ENQUEUE", "nonblocking"),
        ]
        .into();
        let c = BackendConfig::new(1)
            .with_overrides(|k| env.get(k).map(|v| v.to_string()))
            .unwrap();
        assert_eq!(c.collective_timeout, Duration::from_millis(2500));
        assert_eq!(c.fast_path, FastPathPolicy::Never);
        assert_eq!(c.scratch_bytes, 8 << 20);
        assert_eq!(c.dump_dir.as_deref(), Some(std::path::Path::new("/tmp/fr")));
        assert_eq!(c.enqueue, EnqueueMode::NonBlocking);
        assert_eq!(BackendConfig::new(0).enqueue, EnqueueMode::Blocking);
        assert!(
            BackendConfig::new(0)
                .with_overrides(|k| (k == "METRALE_COMM_ENQUEUE").then(|| "fast".to_string()))
                .is_err()
        );
        for bad in ["0", "-1", "abc"] {
            let r = BackendConfig::new(0)
                .with_overrides(|k| (k == "METRALE_COMM_TIMEOUT_SECS").then(|| bad.to_string()));
            assert!(matches!(r, Err(CommError::Config(_))), "{bad}");
        }
    }

    /// Every entry point's precedence: the code's configuration, then the
    /// environment, unless the configuration opts out.
    #[test]
    fn environment_overrides_apply_unless_the_config_opts_out() {
        let env: HashMap<&str, &str> = [
            ("METRALE_COMM_DEVICE", "3"),
            ("METRALE_COMM_ENQUEUE", "nonblocking"),
        ]
        .into();
        let get = |k: &str| env.get(k).map(|v| v.to_string());
        let c = BackendConfig::new(0)
            .with_enqueue(EnqueueMode::Blocking)
            .with_overrides(get)
            .unwrap();
        assert_eq!((c.device, c.enqueue), (3, EnqueueMode::NonBlocking));
        let pinned = BackendConfig::new(0)
            .with_enqueue(EnqueueMode::Blocking)
            .without_env_overrides()
            .with_env_overrides()
            .unwrap();
        assert_eq!((pinned.device, pinned.enqueue), (0, EnqueueMode::Blocking));
        let bad = BackendConfig::new(0)
            .with_overrides(|k| (k == "METRALE_COMM_DEVICE").then(|| "gpu1".to_string()));
        assert!(matches!(bad, Err(CommError::Config(m)) if m.contains("METRALE_COMM_DEVICE")));
    }

    /// Values that cannot be meant are refused with a message naming the
    /// floor or the rule, whichever entry point applies them.
    #[test]
    fn values_that_cannot_be_meant_are_refused() {
        let with = |k: &'static str, v: &'static str| {
            BackendConfig::new(0).with_overrides(move |name| (name == k).then(|| v.to_string()))
        };
        for (k, v, says) in [
            ("METRALE_COMM_TIMEOUT_SECS", "1e-9", "[0.1, 86400]"),
            ("METRALE_COMM_INIT_TIMEOUT_SECS", "0.01", "[0.1, 86400]"),
            ("METRALE_COMM_SHUTDOWN_TIMEOUT_SECS", "NaN", "[0.1, 86400]"),
            ("METRALE_COMM_SCRATCH_BYTES", "0", "at least 65536"),
            ("METRALE_COMM_SCRATCH_BYTES", "65537", "whole bf16"),
            ("METRALE_COMM_FAST_PATH", "16G-32G", "MIN exceeds 1024 MiB"),
            ("METRALE_COMM_FAST_PATH", "0-0", "below one bf16 element"),
            ("METRALE_COMM_FAST_PATH", "0-1", "below one bf16 element"),
        ] {
            match with(k, v) {
                Err(CommError::Config(msg)) => assert!(msg.contains(says), "{k}={v}: {msg}"),
                other => panic!("{k}={v}: {other:?}"),
            }
        }
        assert!(with("METRALE_COMM_TIMEOUT_SECS", "0.1").is_ok());
        assert!(with("METRALE_COMM_SCRATCH_BYTES", "64K").is_ok());
        assert!(with("METRALE_COMM_FAST_PATH", "0-2").is_ok());
        assert!(with("METRALE_COMM_FAST_PATH", "1G-2G").is_ok());
        let built = BackendConfig::new(0)
            .with_collective_timeout(Duration::from_nanos(1))
            .validate();
        assert!(matches!(built, Err(CommError::Config(m)) if m.contains("floor")));
        let built = BackendConfig::new(0).with_scratch_bytes(0).validate();
        assert!(matches!(built, Err(CommError::Config(_))));
        assert!(BackendConfig::new(0).validate().is_ok());
    }
}

#[cfg(test)]
mod tune_tests {
    use super::*;

    #[test]
    fn tuning_off_makes_the_auto_policies_never_and_ranges_stay() {
        let with = |vars: &'static [(&'static str, &'static str)]| {
            BackendConfig::new(0).with_overrides(move |k| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        let off = with(&[("METRALE_COMM_TUNE", "off")]).unwrap();
        assert!(!off.tune);
        let off = off.with_tuning_resolved();
        assert_eq!(
            (off.one_shot, off.fast_path),
            (OneShotPolicy::Never, FastPathPolicy::Never)
        );
        let ranged = with(&[
            ("METRALE_COMM_TUNE", "off"),
            ("METRALE_COMM_ONE_SHOT", "0-64K"),
        ])
        .unwrap()
        .with_tuning_resolved();
        assert_eq!(
            ranged.one_shot,
            OneShotPolicy::Range {
                min_bytes: 0,
                max_bytes: 64 << 10
            },
            "an explicit range wins over the tuner"
        );
        let on = BackendConfig::new(0).with_tuning_resolved();
        assert_eq!(
            (on.one_shot, on.fast_path),
            (OneShotPolicy::Auto, FastPathPolicy::Auto)
        );
        assert!(matches!(
            with(&[("METRALE_COMM_TUNE", "maybe")]),
            Err(CommError::Config(m)) if m.contains("METRALE_COMM_TUNE")
        ));
        assert!(!BackendConfig::new(0).fused_cluster);
        assert!(
            !with(&[("METRALE_COMM_FUSED_CLUSTER", " OFF ")])
                .unwrap()
                .fused_cluster
        );
        assert!(
            with(&[("METRALE_COMM_FUSED_CLUSTER", "on")])
                .unwrap()
                .fused_cluster
        );
        assert!(matches!(
            with(&[("METRALE_COMM_FUSED_CLUSTER", "8")]),
            Err(CommError::Config(m)) if m.contains("METRALE_COMM_FUSED_CLUSTER")
        ));
        let c = with(&[("METRALE_COMM_TUNE_CACHE", "/tmp/x")]).unwrap();
        assert_eq!(c.tune_cache, TuneCache::Dir(PathBuf::from("/tmp/x")));
        let c = with(&[("METRALE_COMM_TUNE_CACHE", "off")]).unwrap();
        assert_eq!(c.tune_cache, TuneCache::Off);
        let c = with(&[("METRALE_COMM_TUNE_TRIALS", " 3x1 ")]).unwrap();
        assert_eq!(
            c.tune_trials,
            Some(Trials {
                trials: 3,
                calls: 1
            })
        );
        assert_eq!(
            with(&[("METRALE_COMM_TUNE_TRIALS", "")])
                .unwrap()
                .tune_trials,
            None
        );
        for bad in ["3", "0x4", "4x0", "x", "2x1001", "-1x2"] {
            let vars: &'static [(&'static str, &'static str)] =
                Box::leak(Box::new([("METRALE_COMM_TUNE_TRIALS", bad)]));
            assert!(
                matches!(with(vars), Err(CommError::Config(m)) if m.contains("METRALE_COMM_TUNE_TRIALS")),
                "{bad}"
            );
        }
        let zero = BackendConfig::new(0).with_tune_trials(Trials {
            trials: 0,
            calls: 4,
        });
        assert!(matches!(zero.validate(), Err(CommError::Config(m)) if m.contains("trials")));
    }
}
