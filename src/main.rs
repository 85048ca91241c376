//! The `fencegate` binary: parse the command line, load the config, bind, and hand over to the
//! library.
#![deny(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use fencegate::Config;
use fencegate::config::{Environment, LogFormat};
use tokio::signal::unix::{Signal, SignalKind, signal};

/// mimalloc rather than glibc's malloc: a request makes about two dozen short-lived
/// allocations, and glibc spent about 300 instructions on each (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(version, about = "A reverse proxy that fences a dumb HTTP backend against stale lock holders")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy until SIGINT or SIGTERM; SIGHUP reloads the config file.
    Run {
        /// TOML config file; FENCEGATE_<SECTION>__<KEY> environment variables override it.
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Make a data directory (or, with an etcd store, its prefix in etcd), once, before the
    /// first `run`. `run` refuses a missing or empty one, which may be a lost one. Refuses one
    /// that already holds state.
    // One of the two names the data dir: a missing one is reported naming both.
    #[command(group = clap::ArgGroup::new("data").required(true).args(["dir", "config"]))]
    Init {
        /// The data directory (`store.dir`).
        #[arg(long, short)]
        dir: Option<PathBuf>,
        /// A config file: its data dir, or its etcd store's prefix with store.kind = "etcd".
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Every resource starts at max_seen = FLOOR: 0 for a new deployment; after losing a
        /// data directory, the lock service's current token or above (for etcd, its current
        /// revision), so that only holders that lock again get through.
        #[arg(long, default_value_t = 0)]
        floor: u64,
    },
    /// Copy a file store's max_seen into the config's etcd store (store.kind = "etcd"), never
    /// lowering a key. Run it with no fencegate running on either.
    Migrate {
        /// TOML config file with store.kind = "etcd".
        #[arg(long, short)]
        config: PathBuf,
        /// The data directory to copy from.
        #[arg(long)]
        from: PathBuf,
    },
    /// Show the rules a shared fence's instances must share, as etcd records them, and what
    /// the config decides otherwise; with --set, record the config's instead (refused while an
    /// instance leads: stop them all first, then start them with the new config).
    Rules {
        /// TOML config file with store.kind = "etcd".
        #[arg(long, short)]
        config: PathBuf,
        /// Record this config's rules as the fence's.
        #[arg(long)]
        set: bool,
    },
    /// Validate a config file and print the effective settings.
    Check {
        /// TOML config file.
        #[arg(long, short)]
        config: PathBuf,
        /// Print nothing when the file is valid (for ExecStartPre=); errors still go to stderr.
        #[arg(long, short)]
        quiet: bool,
        /// Also check Envoy's bootstrap (YAML or JSON) for `server.mode = "ext_proc"`: that no
        /// route lets a write past the processor, retries it or mirrors it.
        #[arg(long)]
        envoy: Option<PathBuf>,
    },
    /// Wait for a while, then exit: a Kubernetes preStop hook in an image without `sleep`.
    Sleep {
        /// How long ("5s", "500ms").
        #[arg(value_parser = humantime::parse_duration)]
        duration: std::time::Duration,
    },
    /// Replay the zombie-lock-holder race against an in-memory backend and show it defeated.
    Demo,
    /// Sign a token for a rule with verify = "hmac": prints the value of the signature header
    /// (Fencing-Token-Signature by default). The key file is read as fencegate reads it.
    #[command(group = clap::ArgGroup::new("expires").required(true).args(["expires_in", "expiry"]))]
    Sign {
        /// The key's secret file, as in [[verify.hmac_keys]] secret_file.
        #[arg(long)]
        key_file: PathBuf,
        /// The key's id, as in [[verify.hmac_keys]] id.
        #[arg(long)]
        kid: String,
        /// The token domain of the keys the token is for.
        #[arg(long, default_value = fencegate::config::DEFAULT_DOMAIN)]
        domain: String,
        /// The token.
        #[arg(long)]
        token: u64,
        /// How long the signature is accepted from now ("10m", "1h").
        #[arg(long, value_parser = humantime::parse_duration)]
        expires_in: Option<std::time::Duration>,
        /// When it is no longer accepted, as a UNIX time in seconds.
        #[arg(long)]
        expiry: Option<u64>,
    },
    /// Read a data directory without starting a proxy: max_seen of one resource, or a summary.
    /// Refuses while a running fencegate holds the directory (then ask its admin API).
    #[command(group = clap::ArgGroup::new("data").required(true).multiple(true).args(["dir", "config"]))]
    Inspect {
        /// The data directory (`store.dir`); without it, the config's.
        #[arg(long, short)]
        dir: Option<PathBuf>,
        /// A config file: its data dir, and its [paths] and [[fence.scopes]] rules for PATH.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// A resource's path as a client writes it (/accounts//42 names /accounts/42), turned
        /// into its fence key by the config's rules, or by the default rules without --config;
        /// omit it for a summary.
        path: Option<String>,
        /// How many of the highest entries the summary lists.
        #[arg(long, default_value_t = 10)]
        top: usize,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check { config, quiet, envoy } => check(&config, quiet, envoy.as_deref()),
        Command::Sleep { duration } => {
            std::thread::sleep(duration);
            Ok(())
        }
        Command::Run { config } => {
            Config::load(&config, None).with_context(|| format!("invalid config {}", config.display())).and_then(|c| {
                let _flush = fencegate::logging::init(&c.log.level, c.log.format, c.log.buffer_lines);
                tracing::info!(version = %env!("CARGO_PKG_VERSION"), config = %config.display(), "fencegate starting");
                log_environment(&Environment::read(None));
                raise_open_files_limit();
                runtime(c.server.workers)?.block_on(serve(config.clone(), c))
            })
        }
        Command::Init { dir: Some(dir), floor, .. } => init(&dir, floor),
        Command::Init { config: Some(config), floor, .. } => init_from(&config, floor),
        Command::Init { .. } => Err(anyhow::anyhow!("init needs --dir or --config")),
        Command::Migrate { config, from } => migrate(&config, &from),
        Command::Rules { config, set } => rules(&config, set),
        Command::Inspect { dir, config, path, top } => inspect(dir, config, path.as_deref(), top),
        Command::Sign { key_file, kid, domain, token, expires_in, expiry } => {
            sign(&key_file, &kid, &domain, token, expires_in, expiry)
        }
        Command::Demo => {
            let _flush = fencegate::logging::init("error", LogFormat::Text, 1024);
            runtime(0).and_then(|rt| rt.block_on(demo()))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fencegate: {e:#}");
            exit_code(&e)
        }
    }
}

/// The exit status of `run` and `check` when the data directory's file system is read-only
/// (sysexits' EX_IOERR): restarting cannot help until an operator repairs it, so a service
/// manager is told not to try (systemd: `RestartPreventExitStatus=74`). Every other failure
/// exits with 1.
const EXIT_READ_ONLY: u8 = 74;

fn exit_code(e: &anyhow::Error) -> ExitCode {
    match e.chain().any(|cause| cause.downcast_ref::<fencegate::Error>().is_some_and(fencegate::Error::read_only)) {
        true => ExitCode::from(EXIT_READ_ONLY),
        false => ExitCode::FAILURE,
    }
}

/// `workers` = 1: one event-loop thread, which costs the least per request on a small sidecar
/// (no work stealing, no cross-thread wake-ups); 0: one worker per CPU.
fn runtime(workers: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = match workers {
        1 => tokio::runtime::Builder::new_current_thread(),
        0 => tokio::runtime::Builder::new_multi_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
    };
    builder.enable_all().build().context("cannot start the runtime")
}

/// `check`; with `quiet`, only errors are printed (`run` logs the warnings again).
fn check(path: &std::path::Path, quiet: bool, envoy: Option<&std::path::Path>) -> anyhow::Result<()> {
    let config = Config::load(path, None).with_context(|| format!("invalid config {}", path.display()))?;
    let mut notes = fencegate::app::check(&config).with_context(|| format!("{} would not run", path.display()))?;
    if let Some(envoy) = envoy {
        let text = std::fs::read_to_string(envoy).with_context(|| format!("cannot read {}", envoy.display()))?;
        let found = fencegate::app::check_envoy(&config, &text).with_context(|| envoy.display().to_string())?;
        if !found.refusals.is_empty() {
            let all = found.refusals.iter().map(|r| format!("\n  - {r}")).collect::<String>();
            anyhow::bail!("{} would let writes past the fence or repeat them:{all}", envoy.display());
        }
        notes.extend(found.warnings.iter().map(|w| format!("warning: {}: {w}", envoy.display())));
    }
    if quiet {
        return Ok(());
    }
    for name in Environment::read(None).ignored {
        println!("# warning: {name} is ignored: {NOT_A_SETTING}");
    }
    for note in notes {
        println!("# {note}");
    }
    println!("# {}: OK. Effective settings:", path.display());
    print!("{}", config.to_toml());
    Ok(())
}

/// Why a `FENCEGATE_*` variable without `__` is ignored.
const NOT_A_SETTING: &str = "settings are FENCEGATE_<SECTION>__<KEY>, with two underscores (FENCEGATE_BACKEND__URL)";

/// Says which `FENCEGATE_*` variables are not settings: Kubernetes service links quietly,
/// anything else (a typo, most likely) loudly.
fn log_environment(env: &Environment) {
    for name in &env.service_links {
        tracing::debug!(variable = %name, "ignoring a Kubernetes service link variable");
    }
    for name in &env.ignored {
        tracing::warn!(variable = %name, "ignoring an environment variable that is not a setting: {NOT_A_SETTING}");
    }
}

fn sign(
    key_file: &std::path::Path,
    kid: &str,
    domain: &str,
    token: u64,
    expires_in: Option<std::time::Duration>,
    expiry: Option<u64>,
) -> anyhow::Result<()> {
    use fencegate::fence::signature;
    let key = signature::Secret::from_file(key_file).with_context(|| format!("key file {}", key_file.display()))?;
    let expiry = match (expiry, expires_in) {
        (Some(at), _) => at,
        (None, Some(d)) => signature::unix_now().saturating_add(d.as_secs()),
        (None, None) => anyhow::bail!("give --expires-in or --expiry"),
    };
    println!("{}", signature::sign(&key, kid, domain, token, expiry)?);
    Ok(())
}

fn init(dir: &std::path::Path, floor: u64) -> anyhow::Result<()> {
    fencegate::app::init_data_dir(dir, floor).with_context(|| format!("cannot initialise {}", dir.display()))?;
    if floor == 0 {
        println!("initialised {} with no floor, as a new deployment's.", dir.display());
        println!("If it held state before, do not start fencegate on it: empty it and run init again with --floor");
        println!("(README: Recovering from a lost volume).");
    } else {
        println!("initialised {}: every resource starts at max_seen = {floor}.", dir.display());
        println!("Writes with a token at or below {floor} are refused: every lock holder must lock again.");
    }
    Ok(())
}

/// `init --config`: the config's data dir, or its etcd store's prefix.
fn init_from(path: &std::path::Path, floor: u64) -> anyhow::Result<()> {
    let config = Config::load(path, None).with_context(|| format!("invalid config {}", path.display()))?;
    let Some(etcd) = config.store.etcd.as_ref() else { return init(&config.store.dir, floor) };
    let prefix = etcd.prefix.clone();
    runtime(1)?
        .block_on(fencegate::app::init_etcd(&config, floor))
        .with_context(|| format!("cannot initialise the fence under {prefix:?} in etcd"))?;
    match floor {
        0 => println!("initialised {prefix:?} in etcd with no floor, as a new deployment's."),
        _ => println!("initialised {prefix:?} in etcd: every resource starts at max_seen = {floor}."),
    }
    Ok(())
}

fn migrate(path: &std::path::Path, from: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(path, None).with_context(|| format!("invalid config {}", path.display()))?;
    let migrated = runtime(1)?
        .block_on(fencegate::app::migrate_to_etcd(&config, from))
        .with_context(|| format!("cannot migrate {} into etcd", from.display()))?;
    println!(
        "migrated {}: {} marks raised in etcd, {} already at or above, {} writes in flight copied (quarantined by the next leader)",
        from.display(),
        migrated.raised,
        migrated.kept,
        migrated.in_flight
    );
    Ok(())
}

fn rules(path: &std::path::Path, set: bool) -> anyhow::Result<()> {
    let config = Config::load(path, None).with_context(|| format!("invalid config {}", path.display()))?;
    let report = runtime(1)?
        .block_on(fencegate::app::rules_etcd(&config, set))
        .context("cannot read the fence's rules in etcd")?;
    match (&report.recorded, report.differences.is_empty(), set) {
        (None, _, false) => println!("no rules recorded yet: the first instance to start records its own"),
        (Some(recorded), true, _) => println!("the fence's rules, which this config shares:\n{recorded}"),
        (Some(_), false, false) => {
            println!("this config decides writes otherwise than the fence's rules:");
            for difference in &report.differences {
                println!("  {difference}");
            }
            println!("instances with this config are refused; `--set` records it, with every instance stopped");
        }
        (_, _, true) => {
            for difference in &report.differences {
                println!("  {difference}");
            }
            println!("recorded this config's rules as the fence's: start every instance with it");
        }
    }
    Ok(())
}

fn inspect(dir: Option<PathBuf>, config: Option<PathBuf>, path: Option<&str>, top: usize) -> anyhow::Result<()> {
    let config = match config {
        Some(c) => Some(Config::load(&c, None).with_context(|| format!("invalid config {}", c.display()))?),
        None => None,
    };
    let dir = match (dir, &config) {
        (Some(dir), _) => dir,
        (None, Some(config)) => config.store.dir.clone(),
        (None, None) => anyhow::bail!("inspect needs --dir or --config"),
    };
    let key = match path {
        Some(path) => {
            let (policy, scopes) = match &config {
                Some(c) => (c.paths.clone(), c.fence.scopes.clone()),
                None => Default::default(),
            };
            let key = fencegate::fence::keys::fence_key(path, &policy, &scopes)
                .with_context(|| format!("{path} is not a path a write could use"))?;
            Some(key)
        }
        None => None,
    };
    let found = match fencegate::store::inspect(&dir) {
        Err(e @ fencegate::store::StoreError::Locked { .. }) => {
            let ask = key.as_deref().map_or_else(|| "GET /fences".to_owned(), |k| format!("GET /fences{k}"));
            return Err(anyhow::Error::new(e)).context(format!(
                "cannot inspect {}: a running fencegate owns it; ask it instead, on its admin API \
                ([admin] listen): {ask}",
                dir.display()
            ));
        }
        found => found.with_context(|| format!("cannot inspect {}", dir.display()))?,
    };
    if let Some(key) = key {
        let named =
            if path == Some(key.as_str()) { String::new() } else { format!(" (fence key of {})", path.unwrap_or("")) };
        match found.table.get(&key) {
            Some(max) => println!("{key} max_seen={max}{named}"),
            None => anyhow::bail!("{key}{named}: never written"),
        }
        return Ok(());
    }
    print!("{}", fencegate::app::inspection_report(&found, &dir, top));
    Ok(())
}

async fn serve(path: PathBuf, config: Config) -> anyhow::Result<()> {
    // Before anything slow (recovery can take seconds): SIGHUP's default action is to kill, and
    // `systemctl reload` may come early. One that arrives during start-up is applied after it.
    let hangups = signal(SignalKind::hangup()).context("cannot listen for SIGHUP")?;
    // Likewise SIGTERM and SIGINT, before binding: a stop that comes during start-up drains
    // the proxy once it is up rather than killing it half-open.
    let shutdown = shutdown_signal()?;
    let supervisor =
        fencegate::app::Supervisor::from_environment().context("cannot use the service manager's settings")?;
    let listener = fencegate::app::bind("server.listen", &config.server.listen, config.server.listen_mode).await?;
    let proxy = fencegate::Proxy::open(config).await?.supervised(supervisor);
    tokio::spawn(reload_on_hangup(proxy.clone(), path, hangups));
    proxy.run(listener, shutdown).await?;
    Ok(())
}

/// On SIGHUP, reads the config file (and the environment) again and applies what can change
/// safely. A config that does not load changes nothing.
async fn reload_on_hangup(proxy: fencegate::Proxy, path: PathBuf, mut hangups: Signal) {
    while hangups.recv().await.is_some() {
        tracing::info!(config = %path.display(), "SIGHUP: reloading the configuration");
        let reloading = proxy.reloading();
        let result = match Config::load(&path, None) {
            Ok(config) => proxy.reload(config).map(drop).map_err(anyhow::Error::from),
            Err(e) => {
                proxy.reload_rejected();
                Err(e.into())
            }
        };
        reloading.finished(result.is_ok());
        if let Err(e) = result {
            tracing::error!(error = format!("{e:#}"), "reload refused: the running configuration is unchanged");
        }
    }
}

/// Resolves at the first SIGTERM or SIGINT from now on (the handlers are installed here, not
/// when it is first polled).
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    let mut term = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot listen for SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("shutdown signal received");
    })
}

async fn demo() -> anyhow::Result<()> {
    let mut out = std::io::stdout();
    if fencegate::demo::run(&mut out).await? { Ok(()) } else { anyhow::bail!("the demo did not behave as expected") }
}

/// Raises the soft limit on open files to the hard limit, as Go's runtime does: a proxy holds
/// at least two descriptors per request in flight (client and backend connections), and the
/// usual soft default of 1024 is reached long before memory or CPU run out. The hard limit
/// stays the operator's ceiling.
fn raise_open_files_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    // An unlimited hard limit cannot be the soft one for descriptors: leave it to the operator.
    let (Some(soft), Some(hard)) = (limit.current, limit.maximum) else { return };
    if soft >= hard {
        return;
    }
    match setrlimit(Resource::Nofile, Rlimit { current: Some(hard), maximum: Some(hard) }) {
        Ok(()) => tracing::info!(from = soft, to = hard, "raised the soft limit on open files to the hard limit"),
        Err(e) => tracing::warn!(error = %e, soft, hard, "cannot raise the soft limit on open files"),
    }
}
