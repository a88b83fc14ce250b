"""A vision-language model on Megatron-Core: a ``GPTModel`` (the language model, multimodal RoPE)
whose first pipeline stage also holds the family's vision tower.

On the first stage the forward embeds the tokens, runs the vision tower over the micro-batch's
images, writes its output into the image placeholder positions (row by row, as transformers'
``masked_scatter``), then scatters the sequence over the tensor-parallel group when sequence
parallelism is on, and continues as ``GPTModel`` with those embeddings. Every stage computes the
rotary frequencies from the ``[3, b, s]`` M-RoPE positions (Megatron's ``mrope``, or the family's
own rotary embedding, :attr:`alignment.models.vlm.VisionSpec.rotary`).

DeepStack (Qwen3-VL): the tower also gives, per image token, the features that the first
``dims.deepstack_layers`` decoder layers add to their output at the image positions (transformers'
``_deepstack_process``). They are spread into ``[s, b, h]`` tensors, zero at every other position (so
the sum there is exact), scattered as the embeddings are under sequence parallelism, and added by a
forward hook on each of those layers; they must all be on the first pipeline stage.

The tower is replicated on every tensor-parallel rank (each computes the same features from the
same images; the gradients reaching it are the full ones on every rank), as Megatron-Bridge runs
Qwen2.5-VL's. Megatron-Core 0.16.1's own ``LLaVAModel`` / ``CLIPViTModel`` have neither window
attention nor 2-D RoPE over variable image sizes, so the HF tower is used as it is.
"""

from __future__ import annotations

import functools

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel


class VisionLanguageModel(GPTModel):
    """``GPTModel`` plus ``vision_model`` (first pipeline stage only).

    Args:
        spec: the family's :class:`alignment.models.vlm.VisionSpec`.
        hf_config: the HF config (its vision part builds the tower).
        dims: the model's :class:`alignment.models.dims.ModelDims` (``image_token_id``).
        **kwargs: ``GPTModel``'s (``position_embedding_type="mrope"``).
    Raises:
        ValueError: the first pipeline stage holds fewer decoder layers than DeepStack feeds.
    """

    def __init__(self, spec, hf_config, dims, **kwargs):
        super().__init__(scatter_embedding_sequence_parallel=False, **kwargs)
        self.spec, self.dims = spec, dims
        if spec.rotary is not None:
            self.rotary_pos_emb = spec.rotary(self.config.kv_channels, kwargs.get("rotary_base", 10000))
        # the M-RoPE positions each rank gets are its own tokens' (padded rows) or the whole packed stream's, of which
        # Megatron's thd rotary takes the rank's share itself (alignment.models.vlm.multimodal_inputs): the rotary must
        # not take a context-parallel share of them
        self.rotary_pos_emb.cp_group = None
        self._deepstack = None  # this forward's DeepStack tensors, [s, b, h] each
        if self.pre_process:
            self.vision_model = spec.tower(hf_config).to(self.config.params_dtype)
            layers = list(self.decoder.layers)
            if dims.deepstack_layers > len(layers):
                raise ValueError(f"the first pipeline stage holds {len(layers)} decoder layers, DeepStack adds image "
                                 f"features to the first {dims.deepstack_layers}: use a smaller "
                                 "parallel.pipeline_model_parallel_size")
            for i in range(dims.deepstack_layers):
                layers[i].register_forward_hook(functools.partial(self._add_deepstack, i))

    def _add_deepstack(self, i, module, args, output):
        if self._deepstack is None:
            return output
        hidden, context = output
        return hidden + self._deepstack[i], context

    def image_features(self, pixel_values, image_grid_thw):
        """The vision tower's output for images ``pixel_values`` ``[patches, C*T*p*p]`` with grids
        ``image_grid_thw`` ``[images, 3]``: ``[image tokens, hidden * (1 + dims.deepstack_layers)]``, image
        by image, in order: the features that fill the placeholders, then those each DeepStack layer adds."""
        out = self.vision_model(pixel_values.to(self.config.params_dtype), grid_thw=image_grid_thw)
        return torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=-1)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, pixel_values=None,
                image_grid_thw=None, image_mask=None, image_features=None, image_index=None, **kwargs):
        """``GPTModel.forward`` with ``position_ids`` ``[3, b, s]`` (M-RoPE) and, on the first stage,
        the images: ``pixel_values`` ``[patches, C*T*p*p]`` and ``image_grid_thw`` ``[images, 3]`` of the
        images whose placeholders ``input_ids`` ``[b, s]`` hold, in order, or their tower output
        ``image_features`` (:meth:`image_features`) already computed (a rollout engine's decode step);
        None: no images. ``image_mask`` ``[b, s]`` bool: the positions the features fill, in order
        (default: every placeholder token; a sampled response's placeholder tokens are text, as in
        transformers' ``generate``). ``image_index`` ``[b, s]`` long: which feature row each position of
        ``image_mask`` takes (its placeholder's rank among the micro-batch's, in ``[b, s]`` order of the whole
        micro-batch: a context-parallel rank holds only some placeholders); None: the features in order.
        Raises ValueError when the positions and the images' token count differ."""
        self._deepstack = None
        if self.pre_process and decoder_input is None:
            embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], whole sequence
            if pixel_values is not None:
                image_features = self.image_features(pixel_values, image_grid_thw)
            if image_features is not None:
                mask = image_mask if image_mask is not None else input_ids == self.dims.image_token_id  # [b, s]
                if image_index is not None:  # this rank's placeholders' rows of the micro-batch's features
                    rows = image_index[mask]
                    if rows.numel() and int(rows.max()) >= image_features.shape[0]:
                        raise ValueError(f"image placeholder {int(rows.max())} of the micro-batch, but only "
                                         f"{image_features.shape[0]} image features from image_grid_thw")
                    image_features = image_features[rows]
                if int(mask.sum()) != image_features.shape[0]:
                    raise ValueError(f"{int(mask.sum())} image placeholder tokens in the micro-batch, "
                                     f"{image_features.shape[0]} image features from image_grid_thw")
                # [image tokens, h] each: the placeholders' features, then DeepStack's
                features, *deep = image_features.to(embeddings.dtype).split(embeddings.shape[-1], dim=-1)
                embeddings = _fill(embeddings, mask, features)
                if deep:
                    self._deepstack = [_fill(torch.zeros_like(embeddings), mask, f) for f in deep]
            if self.config.sequence_parallel:
                embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
                if self._deepstack is not None:
                    self._deepstack = [tensor_parallel.scatter_to_sequence_parallel_region(x) for x in self._deepstack]
            decoder_input = embeddings
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)
        finally:
            self._deepstack = None


def _fill(sbh: torch.Tensor, mask: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """``sbh`` ``[s, b, h]`` with the positions of ``mask`` ``[b, s]`` (in ``[b, s]`` order, as
    transformers' ``masked_scatter``) replaced by the rows of ``features`` ``[mask.sum(), h]``."""
    return sbh.transpose(0, 1).masked_scatter(mask[..., None], features).transpose(0, 1).contiguous()
