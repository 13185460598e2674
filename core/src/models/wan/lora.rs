//! How LoRA files name the Wan transformer's linears. diffusers' keys carry the component
//! (`transformer.blocks.0.attn1.to_q`); the trainers built on Wan's own code (DiffSynth, the
//! ComfyUI exports, lightx2v) write Wan's original module names under `diffusion_model.`
//! (`blocks.0.self_attn.q`, with `lora_A`/`lora_B` or `lora_down`/`lora_up`, an optional
//! `.alpha` and `.diff_b` bias deltas), and musubi-tuner writes them kohya-style
//! (`lora_unet_blocks_0_self_attn_q`). Both map onto the diffusers modules here, as diffusers'
//! `_convert_non_diffusers_wan_lora_to_diffusers` and `_convert_musubi_wan_lora_to_diffusers`
//! map them.

use crate::models::lora::Target;

/// The pipeline's other components, whose keys a Wan LoRA file may carry too.
const OTHERS: [&str; 1] = ["text_encoder"];

/// Binding target of the Wan transformer (`transformer/` of a pipeline folder).
pub fn transformer_target() -> Target<'static> {
    Target {
        component: Some("transformer"),
        others: &OTHERS,
        kohya: Some((&["lora_unet_"], &kohya_modules)),
        original: Some(("diffusion_model.", &original_modules)),
        unprefixed: true,
    }
}

/// The diffusers linear an original Wan module name (`blocks.3.cross_attn.k`) is, or `None`.
pub fn original_modules(name: &str) -> Option<Vec<String>> {
    let one = |s: String| Some(vec![s]);
    if let Some(rest) = name.strip_prefix("blocks.") {
        let (i, part) = rest.split_once('.')?;
        let i: usize = i.parse().ok()?;
        let attn = |which: &str, p: &str| -> Option<String> {
            let to = match p {
                "q" => "to_q",
                "k" => "to_k",
                "v" => "to_v",
                "o" => "to_out.0",
                "k_img" if which == "attn2" => "add_k_proj",
                "v_img" if which == "attn2" => "add_v_proj",
                _ => return None,
            };
            Some(format!("blocks.{i}.{which}.{to}"))
        };
        return match part.split_once('.') {
            Some(("self_attn", p)) => one(attn("attn1", p)?),
            Some(("cross_attn", p)) => one(attn("attn2", p)?),
            Some(("ffn", "0")) => one(format!("blocks.{i}.ffn.net.0.proj")),
            Some(("ffn", "2")) => one(format!("blocks.{i}.ffn.net.2")),
            _ => None,
        };
    }
    match name {
        "text_embedding.0" => one("condition_embedder.text_embedder.linear_1".into()),
        "text_embedding.2" => one("condition_embedder.text_embedder.linear_2".into()),
        "time_embedding.0" => one("condition_embedder.time_embedder.linear_1".into()),
        "time_embedding.2" => one("condition_embedder.time_embedder.linear_2".into()),
        "time_projection.1" => one("condition_embedder.time_proj".into()),
        "head.head" => one("proj_out".into()),
        "patch_embedding" => one("patch_embedding".into()),
        _ => None,
    }
}

/// musubi-tuner's kohya-style names (`blocks_0_self_attn_q`, `lora_unet_` stripped) as the
/// diffusers linears of [`original_modules`].
pub fn kohya_modules(name: &str) -> Option<Vec<String>> {
    let name = name.trim_start_matches('_');
    if let Some(rest) = name.strip_prefix("blocks_") {
        let (i, part) = rest.split_once('_')?;
        let dotted = match part {
            "ffn_0" | "ffn_2" => part.replacen('_', ".", 1),
            _ => {
                let (which, p) = part
                    .strip_prefix("self_attn_")
                    .map(|p| ("self_attn", p))
                    .or_else(|| part.strip_prefix("cross_attn_").map(|p| ("cross_attn", p)))?;
                format!("{which}.{p}")
            }
        };
        return original_modules(&format!("blocks.{i}.{dotted}"));
    }
    let dotted = match name {
        "text_embedding_0" => "text_embedding.0",
        "text_embedding_2" => "text_embedding.2",
        "time_embedding_0" => "time_embedding.0",
        "time_embedding_2" => "time_embedding.2",
        "time_projection_1" => "time_projection.1",
        "head_head" => "head.head",
        "patch_embedding" => "patch_embedding",
        _ => return None,
    };
    original_modules(dotted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wan_names_map_onto_diffusers_modules() {
        for (orig, kohya, want) in [
            (
                "blocks.3.self_attn.o",
                "blocks_3_self_attn_o",
                "blocks.3.attn1.to_out.0",
            ),
            (
                "blocks.0.cross_attn.k",
                "blocks_0_cross_attn_k",
                "blocks.0.attn2.to_k",
            ),
            (
                "blocks.1.cross_attn.v_img",
                "blocks_1_cross_attn_v_img",
                "blocks.1.attn2.add_v_proj",
            ),
            (
                "blocks.12.ffn.0",
                "blocks_12_ffn_0",
                "blocks.12.ffn.net.0.proj",
            ),
            (
                "time_projection.1",
                "time_projection_1",
                "condition_embedder.time_proj",
            ),
            ("head.head", "head_head", "proj_out"),
        ] {
            assert_eq!(
                original_modules(orig),
                Some(vec![want.to_string()]),
                "{orig}"
            );
            assert_eq!(
                kohya_modules(kohya),
                Some(vec![want.to_string()]),
                "{kohya}"
            );
        }
        for none in [
            "blocks.0.norm3",
            "blocks.x.self_attn.q",
            "img_emb.proj.1",
            "blocks.0.self_attn.k_img",
        ] {
            assert!(original_modules(none).is_none(), "{none}");
        }
    }
}
