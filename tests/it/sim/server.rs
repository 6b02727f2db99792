//! One `sluice serve` process of the simulation: started, stopped and killed as a supervisor
//! would, with each start's standard error kept to explain a refusal.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Settings a node can be restarted with: small enough that segments roll, batches spill,
/// flushes, compactions, checkpoints and garbage collection happen between faults, and
/// different enough that a restart meets a log written under other settings.
pub const SETTINGS: [&str; 4] = [
    // Everything small and fast.
    "log_segment_bytes = 131072\nflush_bytes = 262144\nflush_interval_seconds = 0.4\n\
     stream_checkpoint_interval_seconds = 0.4\ngc_grace_seconds = 1\n\
     maintenance_interval_seconds = 0.1\ncompact_min_files = 3\n\
     manifest_checkpoint_interval = 4\nmax_unflushed_bytes = 131072\nflush_quiet_ms = 150\n",
    // The default segment size and memory budget, slower maintenance.
    "flush_interval_seconds = 2\nstream_checkpoint_interval_seconds = 2\n\
     maintenance_interval_seconds = 0.25\ngc_grace_seconds = 2\ncompact_min_files = 4\n",
    // Tiny segments, a large memory budget.
    "log_segment_bytes = 65536\nflush_interval_seconds = 1\n\
     stream_checkpoint_interval_seconds = 1\nmaintenance_interval_seconds = 0.2\n\
     compact_min_files = 2\ngc_grace_seconds = 1\nmanifest_checkpoint_interval = 2\n",
    // A tiny memory budget and long bursts: unflushed batches spill to the log.
    "log_segment_bytes = 262144\nmax_unflushed_bytes = 65536\nflush_quiet_ms = 1000\n\
     flush_interval_seconds = 3\nmaintenance_interval_seconds = 0.1\n\
     stream_checkpoint_interval_seconds = 0.7\ngc_grace_seconds = 1\ncompact_min_files = 3\n",
];

/// How long a start may take before it counts as hung (a debug build, beside other tests,
/// replaying a log of a few MB).
const START_LIMIT: Duration = Duration::from_secs(90);

/// How long a SIGTERM may take to stop the server (it checkpoints and flushes first).
const STOP_LIMIT: Duration = Duration::from_secs(90);

/// One node: its data directory, port and settings outlive its processes.
pub struct Server {
    pub name: String,
    pub dir: PathBuf,
    pub port: u16,
    /// Extra environment (durability, lease) and arguments (object store).
    pub env: Vec<(String, String)>,
    pub args: Vec<String>,
    pub settings: usize,
    child: Option<Child>,
    /// Standard error of the current (or last) process.
    stderr: PathBuf,
    pub starts: u64,
    /// The machine's boot as the node sees it (`SLUICE_TEST_BOOT_ID`): a power loss reboots.
    boot: u64,
    /// Whether the machine rebooted since the last start (a start may then wait a lease for
    /// the previous owner's heartbeat; after a restart on the same boot it must not).
    rebooted: bool,
    /// A cluster node may be fenced (taken over while paused or starved past its lease) and
    /// then exits with an error on purpose; a single node never is.
    pub cluster: bool,
    /// The node id each start served as (from its `node.json`), for a failure's report.
    pub ids: Vec<(u64, String)>,
}

/// What the log line says when a start waits for the last owner of its id.
const LEASE_WAIT: &str = "waiting up to a lease";

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(12)..].join("\n")
}

impl Server {
    pub fn new(name: &str, dir: PathBuf, settings: usize) -> Server {
        std::fs::create_dir_all(&dir).unwrap();
        Server {
            name: name.to_owned(),
            stderr: dir.join("stderr-0.log"),
            dir,
            port: crate::common::free_port(),
            env: Vec::new(),
            args: Vec::new(),
            settings,
            child: None,
            starts: 0,
            boot: 1,
            rebooted: false,
            cluster: false,
            ids: Vec::new(),
        }
    }

    /// The record of every write and sync of the current (or last) process, for a power loss.
    fn sync_record(&self) -> PathBuf {
        self.dir.join(format!("sync-{}.record", self.starts))
    }

    /// The power goes out while the process runs: it dies, and every file is put back to what
    /// its syncs made durable (`SyncJournal`); the machine comes back with a new boot.
    pub fn power_loss(&mut self) -> Result<usize, String> {
        self.kill()?;
        let damaged = sluice::storage::journal::power_loss_from_record(&self.sync_record())
            .map_err(|e| format!("applying the power loss: {e}"))?;
        self.boot += 1;
        self.rebooted = true;
        Ok(damaged)
    }

    /// Whether the process exited by itself (it was not stopped): a crash, or a refusal.
    pub fn exited(&mut self) -> Option<String> {
        let child = self.child.as_mut()?;
        let status = child.try_wait().ok()??;
        self.child = None;
        Some(format!(
            "{} (start {}) exited with {status} by itself; it printed:\n{}",
            self.name,
            self.starts,
            tail(&self.stderr)
        ))
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts a process (with the current settings) and returns at once.
    pub fn spawn(&mut self) {
        assert!(self.child.is_none(), "{} is already running", self.name);
        let config = self.dir.join("sluice.toml");
        std::fs::write(&config, SETTINGS[self.settings]).unwrap();
        self.starts += 1;
        // Keep the last few starts' output: a refusal names its cause there.
        self.stderr = self.dir.join(format!("stderr-{}.log", self.starts % 4));
        let stderr = std::fs::File::create(&self.stderr).unwrap();
        let _ = std::fs::remove_file(self.dir.join(format!("sync-{}.record", self.starts - 1)));
        let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["serve", "--listen", &format!("127.0.0.1:{}", self.port)])
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .arg("--config")
            .arg(&config)
            .args(&self.args)
            .env_remove("SLUICE_API_KEYS")
            .env("SLUICE_LOG", "sluice=warn")
            .env("SLUICE_TEST_SYNC_RECORD", self.sync_record())
            .env("SLUICE_TEST_BOOT_ID", format!("sim-boot-{}", self.boot))
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Starts a process and waits until it answers its health check. A start that exits or
    /// never answers is an error naming what it printed.
    pub async fn start(&mut self) -> Result<Duration, String> {
        let started = Instant::now();
        self.spawn();
        self.wait_up(started).await
    }

    /// Waits until the running process answers its health check.
    pub async fn wait_up(&mut self, started: Instant) -> Result<Duration, String> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        let url = format!("{}/v1/health", self.base());
        loop {
            if let Ok(r) = client.get(&url).send().await
                && r.status() == 200
            {
                // On the same boot, the last owner is this directory's own dead process: no
                // start waits a lease for it.
                let rebooted = std::mem::take(&mut self.rebooted);
                if !rebooted
                    && !self.cluster
                    && std::fs::read_to_string(&self.stderr).is_ok_and(|t| t.contains(LEASE_WAIT))
                {
                    return Err(format!(
                        "{} (start {}) waited a lease for its own dead process; it printed:\n{}",
                        self.name,
                        self.starts,
                        tail(&self.stderr)
                    ));
                }
                let identity = std::fs::read_to_string(self.dir.join("data").join("node.json"))
                    .unwrap_or_default();
                let id = serde_json::from_str::<serde_json::Value>(&identity)
                    .ok()
                    .and_then(|v| v["id"].as_str().map(str::to_owned))
                    .unwrap_or_default();
                self.ids.push((self.starts, id));
                return Ok(started.elapsed());
            }
            if let Some(child) = &mut self.child
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(format!(
                    "{} (start {}) exited with {status} instead of serving; it printed:\n{}",
                    self.name,
                    self.starts,
                    tail(&self.stderr)
                ));
            }
            if started.elapsed() > START_LIMIT {
                return Err(format!(
                    "{} (start {}) did not answer its health check in {START_LIMIT:?}; it printed:\n{}",
                    self.name,
                    self.starts,
                    tail(&self.stderr)
                ));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// `kill -9`, whatever the process is doing. An exit of its own before the kill, other
    /// than success, is an error (a start that refused).
    pub fn kill(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if let Ok(Some(status)) = child.try_wait()
            && !status.success()
        {
            return Err(format!(
                "{} (start {}) had exited with {status} before it was killed; it printed:\n{}",
                self.name,
                self.starts,
                tail(&self.stderr)
            ));
        }
        let _ = child.kill();
        let _ = child.wait();
        Ok(())
    }

    /// Whether the process said it exits because another node took its id over (it is
    /// then meant to exit with an error, for its supervisor to restart it).
    fn fenced(&self) -> bool {
        self.cluster
            && std::fs::read_to_string(&self.stderr).is_ok_and(|t| t.contains("was fenced"))
    }

    /// SIGTERM, and waits for a clean exit (or the exit of a node that was fenced meanwhile).
    pub async fn term(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        signal_term(&child);
        let deadline = Instant::now() + STOP_LIMIT;
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(_)) if self.fenced() => return Ok(()),
                Ok(Some(status)) => {
                    return Err(format!(
                        "{} (start {}) exited with {status} on SIGTERM; it printed:\n{}",
                        self.name,
                        self.starts,
                        tail(&self.stderr)
                    ));
                }
                _ if Instant::now() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "{} (start {}) did not stop within {STOP_LIMIT:?} of SIGTERM; it printed:\n{}",
                        self.name,
                        self.starts,
                        tail(&self.stderr)
                    ));
                }
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// SIGTERM, then `kill -9` after `after` (a kill during shutdown); fine if the process
    /// stopped cleanly first.
    pub async fn term_then_kill(&mut self, after: Duration) -> Result<(), String> {
        let Some(child) = &self.child else {
            return Ok(());
        };
        signal_term(child);
        tokio::time::sleep(after).await;
        if let Some(child) = &mut self.child
            && let Ok(Some(status)) = child.try_wait()
        {
            self.child = None;
            if !status.success() && !self.fenced() {
                return Err(format!(
                    "{} (start {}) exited with {status} on SIGTERM; it printed:\n{}",
                    self.name,
                    self.starts,
                    tail(&self.stderr)
                ));
            }
            return Ok(());
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        Ok(())
    }
}

fn signal_term(child: &Child) {
    signal(child, "-TERM");
}

fn signal(child: &Child, which: &str) {
    let pid = child.id().to_string();
    let _ = Command::new("kill").args([which, &pid]).status();
}

impl Server {
    /// Stops the process where it is (`SIGSTOP`: a VM paused, a process starved), or lets it
    /// go on (`SIGCONT`).
    pub fn pause(&self, paused: bool) {
        if let Some(child) = &self.child {
            signal(child, if paused { "-STOP" } else { "-CONT" });
        }
    }

    /// After a pause: a node that found it was fenced exits with an error on purpose (its
    /// supervisor restarts it); any other exit is an error.
    pub fn exited_fenced(&mut self) -> Result<bool, String> {
        match self.exited() {
            None => Ok(false),
            Some(_) if self.fenced() => Ok(true),
            Some(exit) => Err(exit),
        }
    }
}
