//! Model graph builders on the core graph.

pub mod dit;
pub mod llama;

/// What a model folder holds, by its `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// A decoder-only language model ([`llama`]).
    Llm,
    /// A Flux-style diffusion transformer ([`dit`]).
    Dit,
}

impl ModelKind {
    /// An `*ForCausalLM` architecture or a Llama-family `model_type` is a language model;
    /// diffusers' Flux config (`num_single_layers`, `joint_attention_dim`) a DiT.
    pub fn of_config(c: &serde_json::Value) -> Option<Self> {
        let causal = c
            .get("architectures")
            .and_then(|a| a.as_array())
            .is_some_and(|a| {
                a.iter()
                    .any(|x| x.as_str().is_some_and(|s| s.ends_with("ForCausalLM")))
            });
        let family = c
            .get("model_type")
            .and_then(|m| m.as_str())
            .is_some_and(|m| ["llama", "mistral", "qwen2", "smollm"].contains(&m));
        if causal || family {
            Some(ModelKind::Llm)
        } else if c.get("num_single_layers").is_some() && c.get("joint_attention_dim").is_some() {
            Some(ModelKind::Dit)
        } else {
            None
        }
    }
}
