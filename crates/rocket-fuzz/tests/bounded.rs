//! The CI pass: every target for a few thousand inputs under the watchdog
//! (`cargo test --workspace` runs it), and the watchdog itself catching a hang.

use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_rocket-fuzz");

fn corpus() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

#[test]
fn every_target_survives_a_bounded_run() {
    let findings = tempfile::tempdir().unwrap();
    let out = Command::new(EXE)
        .args(["all", "--iters", "20000", "--seed", "1", "--time-limit", "40", "--crash-dir"])
        .arg(findings.path())
        .arg("--corpus")
        .arg(corpus())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fuzzer found bugs or failed:\n{stdout}\n{stderr}");
    // Every target ran its inputs (the seeds first, so each regression input too).
    for target in ["safetensors", "gguf", "config", "chat-template"] {
        let line = stdout.lines().find(|l| l.starts_with(target)).unwrap_or_else(|| panic!("no {target} row:\n{stdout}"));
        let inputs: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(inputs >= 1000, "{target} ran only {inputs} inputs:\n{stdout}");
    }
}

#[test]
fn seeds_load_and_regressions_end_in_errors() {
    // The seeds are valid files: each loads. The regression inputs (bugs found by
    // fuzzing) end in typed errors.
    for target in ["safetensors", "gguf", "config", "chat-template"] {
        let dir = corpus().join(target);
        let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        let out = Command::new(EXE).arg("replay").arg(target).args(&files).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{target}:\n{stdout}");
        for line in stdout.lines() {
            let regression = line.contains("/regress-");
            let generation_config = line.contains("generation_config");
            if regression || generation_config {
                assert!(line.contains(": error"), "{line}");
            } else {
                assert!(line.contains(": ok"), "a seed does not load: {line}");
            }
        }
    }
}

/// The harness itself: a hang, an abort and a panic at iteration 1 are each
/// saved as a finding, the run goes on past them, and the exit status is 1.
#[test]
fn the_watchdog_saves_hangs_aborts_and_panics() {
    for (mode, finding) in [("hang", "config-hang-iter1.bin"), ("abort", "config-crash-iter1.bin"), ("panic", "config-panic-iter1.bin")] {
        let findings = tempfile::tempdir().unwrap();
        let out = Command::new(EXE)
            .args(["config", "--iters", "50", "--time-limit", "30", "--input-timeout-ms", "300", "--selftest", mode, "--crash-dir"])
            .arg(findings.path())
            .arg("--corpus")
            .arg(corpus())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{mode}: {stdout}");
        assert!(findings.path().join(finding).is_file(), "{mode}: no {finding}\n{stdout}");
        let row = stdout.lines().find(|l| l.starts_with("config")).unwrap();
        let inputs: u64 = row.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(inputs >= 48, "{mode}: the run did not go on after the finding: {row}");
    }
}
