//! The embedded PTX/cubin pairs (rocket.*, the shipped kernels, and
//! diagnostics.*, the probes) must come from the kernel sources in the tree:
//! kernels/build/MANIFEST (written by kernels/build.sh) records the hash of every
//! source and artifact; a source edited without rerunning the build fails here,
//! with no nvcc needed.

use std::path::Path;

use sha2::{Digest, Sha256};

fn kernels_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels"))
}

fn sha256_hex(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn kernel_artifacts_are_built_from_the_current_sources() {
    let dir = kernels_dir();
    let manifest = std::fs::read_to_string(dir.join("build/MANIFEST")).expect("kernels/build/MANIFEST missing: run kernels/build.sh");
    let mut listed = Vec::new();
    for line in manifest.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let (hash, name) = line.split_once("  ").expect("MANIFEST lines are `sha256  path`");
        let path = if name.starts_with("build/") { dir.join(name) } else { dir.join("src").join(name) };
        assert_eq!(sha256_hex(&path), hash, "{name} changed since kernels/build.sh last ran: rebuild the kernels");
        listed.push(name.to_string());
    }
    for entry in std::fs::read_dir(dir.join("src")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".cu") || name.ends_with(".cuh") {
            assert!(listed.contains(&name), "kernels/src/{name} is not in the MANIFEST: rebuild the kernels");
        }
    }
    for artifact in ["build/rocket.ptx", "build/rocket.sm_90a.cubin", "build/diagnostics.ptx", "build/diagnostics.sm_90a.cubin"] {
        assert!(listed.iter().any(|l| l == artifact), "{artifact} missing from the MANIFEST");
    }
    assert!(manifest.starts_with("# nvcc V13.0."), "kernels must be built with the pinned nvcc 13.0");
}

/// Entry points of a PTX file (`.entry NAME(`).
fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines().filter_map(|l| l.trim().strip_prefix(".visible .entry ")).map(|l| l.split('(').next().unwrap().trim().to_string()).collect()
}

#[test]
fn the_probes_ship_only_in_the_diagnostics_image() {
    let dir = kernels_dir();
    let read = |name: &str| std::fs::read_to_string(dir.join("build").join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let (product, diagnostics) = (ptx_entries(&read("rocket.ptx")), ptx_entries(&read("diagnostics.ptx")));
    assert!(product.iter().any(|e| e == "megakernel_llama_3_2_1b") && product.iter().any(|e| e == "rms_norm"), "{product:?}");
    for probe in ["l2_latency", "fence_cost", "stream_ldg", "stream_ring_16k"] {
        assert!(diagnostics.iter().any(|e| e == probe), "{probe} missing from diagnostics.ptx: {diagnostics:?}");
        assert!(!product.iter().any(|e| e == probe), "{probe} is in the shipped rocket.ptx");
    }
    assert!(!diagnostics.iter().any(|e| product.contains(e)), "a kernel in both images: {diagnostics:?}");
}
