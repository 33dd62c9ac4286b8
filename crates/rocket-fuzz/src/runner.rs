//! The fuzzing loop and its watchdog.
//!
//! A supervisor process starts a worker process (this binary again) and watches
//! it through a small shared-memory page where the worker writes the input it is
//! about to run. The worker catches panics itself (and saves the input); an
//! abort, a crash (stack overflow, allocation failure under the worker's memory
//! limit) or an input that runs past its time limit ends the worker: the
//! supervisor saves that input from the shared page and starts a new worker at
//! the next iteration.

use std::collections::{BTreeMap, HashSet};
use std::fs::OpenOptions;
use std::hash::{Hash, Hasher};
use std::io::Read;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::mutate::{iteration_rng, mutate, MAX_INPUT};
use crate::targets::{Outcome, Runner, Target};

#[derive(Debug, Clone)]
pub struct Settings {
    pub iters: u64,
    pub seed: u64,
    pub corpus: PathBuf,
    /// Wall-clock seconds per target.
    pub time_limit: f64,
    pub input_timeout_ms: u64,
    pub mem_limit_mb: u64,
    pub crash_dir: PathBuf,
    /// Stack of the thread that runs the inputs (a server thread's size).
    pub stack_kb: usize,
    /// Checks of the harness itself: at iteration 1 the worker hangs, aborts or
    /// panics instead of running the target.
    pub selftest: Option<SelfTest>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelfTest {
    Hang,
    Abort,
    Panic,
}

impl SelfTest {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "hang" => Some(SelfTest::Hang),
            "abort" => Some(SelfTest::Abort),
            "panic" => Some(SelfTest::Panic),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            SelfTest::Hang => "hang",
            SelfTest::Abort => "abort",
            SelfTest::Panic => "panic",
        }
    }
}

/// What one target's run found.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub inputs: u64,
    pub ok: u64,
    pub errors: u64,
    pub panics: u64,
    pub crashes: u64,
    pub hangs: u64,
    pub seconds: f64,
    pub corpus: u64,
    pub error_kinds: BTreeMap<String, u64>,
    pub findings: Vec<PathBuf>,
}

impl Report {
    pub fn bugs(&self) -> u64 {
        self.panics + self.crashes + self.hangs
    }
}

// ---- shared page -------------------------------------------------------------

const SLOT_ITER: usize = 0;
const SLOT_BUSY: usize = 1;
const SLOT_LEN: usize = 2;
const SLOT_DONE: usize = 3;
const SLOT_OK: usize = 4;
const SLOT_ERR: usize = 5;
const SLOT_PANICS: usize = 6;
const HEADER: usize = 64;

struct Shared {
    map: MmapMut,
}

impl Shared {
    fn create(path: &Path) -> std::io::Result<Self> {
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        f.set_len((HEADER + MAX_INPUT) as u64)?;
        // SAFETY: a file only this run's supervisor and worker use.
        let map = unsafe { MmapMut::map_mut(&f)? };
        Ok(Shared { map })
    }

    fn open(path: &Path) -> std::io::Result<Self> {
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        // SAFETY: as in `create`.
        let map = unsafe { MmapMut::map_mut(&f)? };
        Ok(Shared { map })
    }

    fn slot(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the map is page-aligned and at least HEADER bytes long; slots are
        // only accessed atomically, by the two processes sharing the file.
        unsafe { AtomicU64::from_ptr(self.map.as_ptr().add(i * 8) as *mut u64) }
    }

    fn get(&self, i: usize) -> u64 {
        self.slot(i).load(Ordering::Acquire)
    }

    fn set(&self, i: usize, v: u64) {
        self.slot(i).store(v, Ordering::Release)
    }

    fn put_input(&mut self, iter: u64, data: &[u8]) {
        let n = data.len().min(MAX_INPUT);
        self.map[HEADER..HEADER + n].copy_from_slice(&data[..n]);
        self.set(SLOT_LEN, n as u64);
        self.set(SLOT_ITER, iter);
        self.set(SLOT_BUSY, 1);
    }

    fn input(&self) -> Vec<u8> {
        let n = (self.get(SLOT_LEN) as usize).min(MAX_INPUT);
        self.map[HEADER..HEADER + n].to_vec()
    }
}

// ---- corpus ------------------------------------------------------------------

pub fn load_corpus(dir: &Path, target: Target) -> std::io::Result<Vec<Vec<u8>>> {
    let dir = dir.join(target.name());
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let corpus: Vec<Vec<u8>> = files.iter().map(std::fs::read).collect::<std::io::Result<_>>()?;
    if corpus.is_empty() {
        return Err(std::io::Error::other(format!("no seed files in {}", dir.display())));
    }
    Ok(corpus)
}

/// Outcomes that differ in this signature count as new behaviour: the input joins the corpus.
fn signature(outcome: &Outcome) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    match outcome {
        Outcome::Ok => "ok".hash(&mut h),
        Outcome::Err(e) => {
            let text = e.to_string();
            let mut norm = String::new();
            let mut quoted = false;
            for c in text.chars().take(160) {
                match c {
                    '"' => quoted = !quoted,
                    _ if quoted => {}
                    '0'..='9' => {
                        if !norm.ends_with('#') {
                            norm.push('#')
                        }
                    }
                    c => norm.push(c),
                }
            }
            norm.hash(&mut h);
        }
    }
    h.finish()
}

fn kind_name(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Ok => "ok".into(),
        Outcome::Err(e) => {
            let d = format!("{e:?}");
            d.split(|c: char| !c.is_alphanumeric()).next().unwrap_or("?").to_string()
        }
    }
}

/// Panicking inputs saved per worker.
const MAX_SAVED_PANICS: u64 = 20;

static PANIC_MESSAGE: Mutex<String> = Mutex::new(String::new());

fn save_finding(dir: &Path, target: Target, what: &str, iter: u64, input: &[u8], detail: &str) -> PathBuf {
    let _ = std::fs::create_dir_all(dir);
    let path = dir.join(format!("{}-{what}-iter{iter}.bin", target.name()));
    let _ = std::fs::write(&path, input);
    let note = format!(
        "{what} in target {} at iteration {iter}\n{detail}\nreproduce: rocket-fuzz replay {} {}\n",
        target.name(),
        target.name(),
        path.display()
    );
    let _ = std::fs::write(path.with_extension("txt"), note);
    path
}

// ---- worker ------------------------------------------------------------------

pub struct WorkerArgs {
    pub target: Target,
    pub from: u64,
    pub to: u64,
    pub deadline_secs: f64,
    pub shm: PathBuf,
}

/// The loop inside the worker process. Writes its counters to the shared page
/// and a summary line (`kinds k=n ...`) on stdout when it ends normally.
pub fn worker(s: &Settings, w: &WorkerArgs) -> std::io::Result<()> {
    limit_memory(s.mem_limit_mb);
    std::panic::set_hook(Box::new(|info| {
        let loc = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        *PANIC_MESSAGE.lock().unwrap_or_else(|p| p.into_inner()) = format!("panic: {msg}{loc}");
    }));
    let mut corpus = load_corpus(&s.corpus, w.target)?;
    let seeds = corpus.len();
    let mut shared = Shared::open(&w.shm)?;
    let settings = s.clone();
    let (target, from, to, deadline_secs) = (w.target, w.from, w.to, w.deadline_secs);
    let handle = std::thread::Builder::new().stack_size(s.stack_kb * 1024).spawn(move || {
        let s = settings;
        let runner = Runner::new();
        let start = Instant::now();
        let mut seen: HashSet<u64> = HashSet::new();
        let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
        let mut iter = from;
        while iter < to {
            if iter % 64 == 0 && start.elapsed().as_secs_f64() > deadline_secs {
                break;
            }
            let mut rng = iteration_rng(s.seed, target, iter);
            // The first pass runs every seed as it is (regression inputs included).
            let input = if (iter as usize) < seeds { corpus[iter as usize].clone() } else { mutate(&mut rng, target, &corpus) };
            shared.put_input(iter, &input);
            let result = catch_unwind(AssertUnwindSafe(|| {
                match s.selftest.filter(|_| iter == 1) {
                    Some(SelfTest::Hang) => loop {
                        std::thread::sleep(Duration::from_secs(1));
                    },
                    Some(SelfTest::Abort) => std::process::abort(),
                    Some(SelfTest::Panic) => panic!("self-test panic"),
                    None => runner.run(target, &input),
                }
            }));
            shared.set(SLOT_BUSY, 0);
            shared.set(SLOT_DONE, shared.get(SLOT_DONE) + 1);
            match result {
                Ok(outcome) => {
                    *kinds.entry(kind_name(&outcome)).or_default() += 1;
                    shared.set(if matches!(outcome, Outcome::Ok) { SLOT_OK } else { SLOT_ERR }, shared.get(if matches!(outcome, Outcome::Ok) { SLOT_OK } else { SLOT_ERR }) + 1);
                    if seen.insert(signature(&outcome)) && iter as usize >= seeds {
                        if corpus.len() < 1024 {
                            corpus.push(input);
                        } else {
                            let i = seeds + rng.below(corpus.len() - seeds);
                            corpus[i] = input;
                        }
                    }
                }
                Err(_) => {
                    let panics = shared.get(SLOT_PANICS) + 1;
                    shared.set(SLOT_PANICS, panics);
                    let msg = std::mem::take(&mut *PANIC_MESSAGE.lock().unwrap_or_else(|p| p.into_inner()));
                    // One bug tends to panic on many inputs: the first few are enough.
                    if panics <= MAX_SAVED_PANICS {
                        let path = save_finding(&s.crash_dir, target, "panic", iter, &input, &msg);
                        eprintln!("rocket-fuzz: {} iteration {iter}: {msg} (input saved to {})", target.name(), path.display());
                    }
                }
            }
            iter += 1;
        }
        (kinds, corpus.len())
    })?;
    let (kinds, corpus_len) = handle.join().map_err(|_| std::io::Error::other("fuzz thread failed"))?;
    let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k}={n}")).collect();
    println!("kinds {} corpus={corpus_len}", kinds.join(" "));
    Ok(())
}

fn limit_memory(mb: u64) {
    if mb == 0 {
        return;
    }
    let bytes = mb.saturating_mul(1 << 20);
    let lim = libc::rlimit { rlim_cur: bytes as libc::rlim_t, rlim_max: bytes as libc::rlim_t };
    // SAFETY: plain syscall on this process with a valid struct.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) };
    if rc != 0 {
        eprintln!("rocket-fuzz: cannot limit memory to {mb} MB: {}", std::io::Error::last_os_error());
    }
}

// ---- supervisor ----------------------------------------------------------------

/// Run `target` for `s.iters` inputs or `s.time_limit` seconds under the watchdog.
pub fn supervise(exe: &Path, s: &Settings, target: Target) -> std::io::Result<Report> {
    std::fs::create_dir_all(&s.crash_dir)?;
    let shm_path = s.crash_dir.join(format!(".{}-{}.shm", target.name(), std::process::id()));
    let shared = Shared::create(&shm_path)?;
    let start = Instant::now();
    let mut report = Report::default();
    let mut from = 0u64;
    let mut restarts = 0;
    let result = loop {
        let left = s.time_limit - start.elapsed().as_secs_f64();
        if from >= s.iters || left <= 0.0 {
            break Ok(());
        }
        for slot in [SLOT_BUSY, SLOT_DONE, SLOT_OK, SLOT_ERR, SLOT_PANICS] {
            shared.set(slot, 0);
        }
        shared.set(SLOT_ITER, from);
        let mut child = Command::new(exe)
            .arg("__worker")
            .arg(target.name())
            .args(["--from", &from.to_string(), "--to", &s.iters.to_string()])
            .args(["--deadline-secs", &format!("{left:.3}"), "--shm"])
            .arg(&shm_path)
            .args(["--seed", &s.seed.to_string(), "--corpus"])
            .arg(&s.corpus)
            .arg("--crash-dir")
            .arg(&s.crash_dir)
            .args(["--mem-limit-mb", &s.mem_limit_mb.to_string(), "--stack-kb", &s.stack_kb.to_string()])
            .args(s.selftest.iter().flat_map(|t| ["--selftest", t.name()]))
            // One thread for rayon: the loaders convert tensors in parallel.
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::piped())
            .spawn()?;
        let mut watched = (u64::MAX, Instant::now());
        let mut hang = false;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            let (iter, busy) = (shared.get(SLOT_ITER), shared.get(SLOT_BUSY));
            if busy == 0 || iter != watched.0 {
                watched = (iter, Instant::now());
            } else if watched.1.elapsed() > Duration::from_millis(s.input_timeout_ms) {
                hang = true;
                let _ = child.kill();
                break child.wait()?;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut out = String::new();
        if let Some(mut o) = child.stdout.take() {
            let _ = o.read_to_string(&mut out);
        }
        report.inputs += shared.get(SLOT_DONE);
        report.ok += shared.get(SLOT_OK);
        report.errors += shared.get(SLOT_ERR);
        report.panics += shared.get(SLOT_PANICS);
        for word in out.split_whitespace() {
            if let Some((k, n)) = word.split_once('=') {
                match (k, n.parse::<u64>()) {
                    ("corpus", Ok(n)) => report.corpus = report.corpus.max(n),
                    (k, Ok(n)) => *report.error_kinds.entry(k.to_string()).or_default() += n,
                    _ => {}
                }
            }
        }
        if status.success() && !hang {
            break Ok(());
        }
        // The worker died on (or hung in) the input in the shared page.
        let iter = shared.get(SLOT_ITER);
        let input = shared.input();
        let (what, detail) = if hang {
            report.hangs += 1;
            ("hang", format!("no result after {} ms", s.input_timeout_ms))
        } else {
            report.crashes += 1;
            ("crash", format!("worker ended with {status}"))
        };
        let path = save_finding(&s.crash_dir, target, what, iter, &input, &detail);
        eprintln!("rocket-fuzz: {} iteration {iter}: {what} ({detail}); input saved to {}", target.name(), path.display());
        report.findings.push(path);
        from = iter + 1;
        restarts += 1;
        if restarts > 20 {
            break Err(std::io::Error::other("more than 20 worker crashes; stopping"));
        }
    };
    report.seconds = start.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&shm_path);
    if report.panics > 0 {
        // Panic inputs were saved by the worker.
        for e in std::fs::read_dir(&s.crash_dir)?.flatten() {
            let p = e.path();
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if name.starts_with(&format!("{}-panic-", target.name())) && name.ends_with(".bin") {
                report.findings.push(p);
            }
        }
    }
    result.map(|()| report)
}

/// Run saved inputs through `target` in this process; returns how many panicked.
pub fn replay(s: &Settings, target: Target, files: &[PathBuf]) -> std::io::Result<usize> {
    limit_memory(s.mem_limit_mb);
    let runner = Runner::new();
    let mut panics = 0;
    for f in files {
        let data = std::fs::read(f)?;
        let t = Instant::now();
        match catch_unwind(AssertUnwindSafe(|| runner.run(target, &data))) {
            Ok(Outcome::Ok) => println!("{}: ok ({:.1} ms)", f.display(), t.elapsed().as_secs_f64() * 1e3),
            Ok(Outcome::Err(e)) => println!("{}: error ({:.1} ms): {e}", f.display(), t.elapsed().as_secs_f64() * 1e3),
            Err(_) => {
                panics += 1;
                println!("{}: PANIC", f.display());
            }
        }
    }
    Ok(panics)
}
