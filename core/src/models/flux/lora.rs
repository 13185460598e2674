//! How LoRA files name the Flux transformer's linears: diffusers' keys carry the component
//! (`transformer.`), kohya sd-scripts name BFL's original modules, some fused (`qkv`,
//! `linear1`), which map onto the diffusers modules here in the order their rows are stacked.

use crate::models::lora::Target;

/// The pipeline's other components, whose keys a Flux LoRA file may carry too.
const OTHERS: [&str; 2] = ["text_encoder", "text_encoder_2"];

/// Binding target of the Flux transformer (`transformer/` of a pipeline folder).
pub fn transformer_target() -> Target<'static> {
    Target {
        component: Some("transformer"),
        others: &OTHERS,
        kohya: Some(&kohya_modules),
        original: None,
    }
}

/// The diffusers linears a kohya module (without `lora_unet_`) covers, or `None` where it
/// names none (the final layer's modulation is refused: BFL stacks its shift and scale in the
/// other order, which a low-rank pair's rows cannot follow without a copy).
pub fn kohya_modules(name: &str) -> Option<Vec<String>> {
    let one = |s: &str| Some(vec![s.to_string()]);
    match name {
        "img_in" => return one("x_embedder"),
        "txt_in" => return one("context_embedder"),
        "final_layer_linear" => return one("proj_out"),
        _ => {}
    }
    for (bfl, diffusers) in [
        ("time_in", "timestep_embedder"),
        ("vector_in", "text_embedder"),
        ("guidance_in", "guidance_embedder"),
    ] {
        if let Some(layer) = name.strip_prefix(bfl).and_then(|r| r.strip_prefix('_')) {
            let l = match layer {
                "in_layer" => "linear_1",
                "out_layer" => "linear_2",
                _ => return None,
            };
            return one(&format!("time_text_embed.{diffusers}.{l}"));
        }
    }
    let (kind, rest) = if let Some(r) = name.strip_prefix("double_blocks_") {
        ("double", r)
    } else if let Some(r) = name.strip_prefix("single_blocks_") {
        ("single", r)
    } else {
        return None;
    };
    let (i, part) = rest.split_once('_')?;
    let i: usize = i.parse().ok()?;
    let many =
        |pre: &str, parts: &[&str]| Some(parts.iter().map(|p| format!("{pre}.{p}")).collect());
    if kind == "double" {
        let pre = format!("transformer_blocks.{i}");
        match part {
            "img_attn_qkv" => many(&pre, &["attn.to_q", "attn.to_k", "attn.to_v"]),
            "img_attn_proj" => many(&pre, &["attn.to_out.0"]),
            "img_mlp_0" => many(&pre, &["ff.net.0.proj"]),
            "img_mlp_2" => many(&pre, &["ff.net.2"]),
            "img_mod_lin" => many(&pre, &["norm1.linear"]),
            "txt_attn_qkv" => many(
                &pre,
                &["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
            ),
            "txt_attn_proj" => many(&pre, &["attn.to_add_out"]),
            "txt_mlp_0" => many(&pre, &["ff_context.net.0.proj"]),
            "txt_mlp_2" => many(&pre, &["ff_context.net.2"]),
            "txt_mod_lin" => many(&pre, &["norm1_context.linear"]),
            _ => None,
        }
    } else {
        let pre = format!("single_transformer_blocks.{i}");
        match part {
            "linear1" => many(&pre, &["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]),
            "linear2" => many(&pre, &["proj_out"]),
            "modulation_lin" => many(&pre, &["norm.linear"]),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kohya_names_map_onto_diffusers_modules() {
        assert_eq!(
            kohya_modules("single_blocks_12_linear1").expect("linear1"),
            [
                "single_transformer_blocks.12.attn.to_q",
                "single_transformer_blocks.12.attn.to_k",
                "single_transformer_blocks.12.attn.to_v",
                "single_transformer_blocks.12.proj_mlp"
            ]
        );
        assert_eq!(
            kohya_modules("double_blocks_0_txt_mod_lin").expect("mod"),
            ["transformer_blocks.0.norm1_context.linear"]
        );
        assert_eq!(
            kohya_modules("guidance_in_out_layer").expect("guidance"),
            ["time_text_embed.guidance_embedder.linear_2"]
        );
        for none in [
            "final_layer_adaLN_modulation_1",
            "double_blocks_x_img_in",
            "unet_mid",
        ] {
            assert!(kohya_modules(none).is_none(), "{none}");
        }
    }
}
