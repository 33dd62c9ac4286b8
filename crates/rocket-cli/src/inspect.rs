//! `rocket inspect`: what a model is, as rocket sees it.

use std::path::PathBuf;

use rocket_core::{Device, Engine, EngineOptions};

#[derive(clap::Args)]
pub struct InspectArgs {
    /// HF model folder or .gguf file
    model: PathBuf,
}

fn human(n: f64, unit: &str) -> String {
    let (v, p) = if n >= 1e9 {
        (n / 1e9, "G")
    } else if n >= 1e6 {
        (n / 1e6, "M")
    } else if n >= 1e3 {
        (n / 1e3, "k")
    } else {
        (n, "")
    };
    format!("{v:.3} {p}{unit}")
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    let engine = Engine::load(&args.model, EngineOptions { device: Device::Cpu, ..EngineOptions::default() })?;
    let info = engine.info();
    let s = &info.spec;
    let mut rows: Vec<(String, String)> = vec![
        ("model".into(), info.path.display().to_string()),
        ("format".into(), format!("{:?}", info.format)),
        ("family".into(), s.family.name().into()),
        ("layers".into(), s.num_layers.to_string()),
        ("hidden_size".into(), s.hidden_size.to_string()),
        ("intermediate_size".into(), s.intermediate_size.to_string()),
        ("heads (q / kv) x head_dim".into(), format!("{} / {} x {}", s.num_heads, s.num_kv_heads, s.head_dim)),
        ("vocab_size".into(), s.vocab_size.to_string()),
        ("max_position_embeddings".into(), s.max_position_embeddings.to_string()),
        ("rms_norm_eps".into(), format!("{:.3e}", s.rms_norm_eps)),
        ("rope".into(), match &s.rope_scaling {
            None => format!("theta {}", s.rope_theta),
            Some(r) => format!(
                "theta {}, llama3 scaling x{} (low {}, high {}, original context {})",
                s.rope_theta, r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings
            ),
        }),
        ("tied embeddings".into(), s.tie_word_embeddings.to_string()),
        ("q/k norm".into(), s.qk_norm.to_string()),
        ("parameters".into(), format!("{} ({})", s.parameter_count(), human(s.parameter_count() as f64, ""))),
        ("bytes read per decode step".into(), human(info.bytes_per_decode_step as f64, "B")),
        ("KV cache per token (bf16)".into(), human((s.num_layers * 2 * s.kv_dim() * 2) as f64, "B")),
    ];
    for (group, dtype) in &info.dtype_groups {
        rows.push((format!("dtype: {group}"), dtype.clone()));
    }
    rows.push(("tokenizer size".into(), info.tokenizer_size.to_string()));
    rows.push(("eos token ids".into(), format!("{:?}", info.eos_token_ids)));
    rows.push(("chat template".into(), if info.has_chat_template { "present" } else { "absent" }.into()));
    rows.push(("load time".into(), format!("{:.2} s", info.load_seconds)));
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        println!("{k:<width$}  {v}");
    }
    Ok(())
}
