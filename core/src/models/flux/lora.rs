//! How LoRA files name the Flux pipeline's linears: diffusers' keys carry the component
//! (`transformer.`, `text_encoder.` for CLIP, `text_encoder_2.` for T5), kohya sd-scripts name
//! BFL's original transformer modules (`lora_unet_`), some fused (`qkv`, `linear1`), which map
//! onto the diffusers modules here in the order their rows are stacked, and the text encoders'
//! modules with underscores (`lora_te1_`, `lora_te2_`).

use crate::models::lora::Target;

/// The pipeline's other components, whose keys a Flux LoRA file may carry too.
const OTHERS: [&str; 2] = ["text_encoder", "text_encoder_2"];

/// Binding target of the Flux transformer (`transformer/` of a pipeline folder).
pub fn transformer_target() -> Target<'static> {
    Target {
        component: Some("transformer"),
        others: &OTHERS,
        kohya: Some((&["lora_unet_"], &kohya_modules)),
        original: None,
        unprefixed: true,
    }
}

/// The other models of a Flux pipeline, as seen from CLIP's and T5's bindings.
const NOT_CLIP: [&str; 2] = ["transformer", "text_encoder_2"];
const NOT_T5: [&str; 2] = ["transformer", "text_encoder"];

/// Binding target of CLIP (`text_encoder/`): diffusers' `text_encoder.` keys, kohya's
/// `lora_te1_`.
pub fn clip_target() -> Target<'static> {
    Target {
        component: Some("text_encoder"),
        others: &NOT_CLIP,
        kohya: Some((&["lora_te1_", "lora_te_"], &clip_kohya_modules)),
        original: None,
        unprefixed: false,
    }
}

/// Binding target of T5 (`text_encoder_2/`): diffusers' `text_encoder_2.` keys, kohya's
/// `lora_te2_`.
pub fn t5_target() -> Target<'static> {
    Target {
        component: Some("text_encoder_2"),
        others: &NOT_T5,
        kohya: Some((&["lora_te2_"], &t5_kohya_modules)),
        original: None,
        unprefixed: false,
    }
}

/// CLIP's linears by kohya's names (`text_model_encoder_layers_0_self_attn_q_proj`).
pub fn clip_kohya_modules(name: &str) -> Option<Vec<String>> {
    let rest = name.strip_prefix("text_model_encoder_layers_")?;
    let (i, part) = rest.split_once('_')?;
    let i: usize = i.parse().ok()?;
    let leaf = match part {
        "self_attn_q_proj" => "self_attn.q_proj",
        "self_attn_k_proj" => "self_attn.k_proj",
        "self_attn_v_proj" => "self_attn.v_proj",
        "self_attn_out_proj" => "self_attn.out_proj",
        "mlp_fc1" => "mlp.fc1",
        "mlp_fc2" => "mlp.fc2",
        _ => return None,
    };
    Some(vec![format!("text_model.encoder.layers.{i}.{leaf}")])
}

/// T5's linears by kohya's names (`encoder_block_0_layer_0_SelfAttention_q`).
pub fn t5_kohya_modules(name: &str) -> Option<Vec<String>> {
    let rest = name.strip_prefix("encoder_block_")?;
    let (i, rest) = rest.split_once("_layer_")?;
    let (j, part) = rest.split_once('_')?;
    let (i, j): (usize, usize) = (i.parse().ok()?, j.parse().ok()?);
    let leaf = match part {
        "SelfAttention_q"
        | "SelfAttention_k"
        | "SelfAttention_v"
        | "SelfAttention_o"
        | "DenseReluDense_wi"
        | "DenseReluDense_wo"
        | "DenseReluDense_wi_0"
        | "DenseReluDense_wi_1" => part.replacen('_', ".", 1),
        _ => return None,
    };
    Some(vec![format!("encoder.block.{i}.layer.{j}.{leaf}")])
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
        assert_eq!(
            clip_kohya_modules("text_model_encoder_layers_3_self_attn_out_proj").expect("clip"),
            ["text_model.encoder.layers.3.self_attn.out_proj"]
        );
        assert_eq!(
            t5_kohya_modules("encoder_block_1_layer_1_DenseReluDense_wi_0").expect("t5"),
            ["encoder.block.1.layer.1.DenseReluDense.wi_0"]
        );
        assert_eq!(
            t5_kohya_modules("encoder_block_0_layer_0_SelfAttention_o").expect("t5"),
            ["encoder.block.0.layer.0.SelfAttention.o"]
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
