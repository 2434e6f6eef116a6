"""TrainingBlock and ForwardBlock: blocks that produce whole models."""

from __future__ import annotations

from abc import abstractmethod

import onnx_ir as ir

from onnxtrain.errors import ArtifactError
from onnxtrain.ir import io
from onnxtrain.onnxblock._context import active
from onnxtrain.onnxblock._training import Parameters, build_training_and_eval, select_parameters
from onnxtrain.onnxblock.blocks import Block


def _register_outputs(model: ir.Model, output_names) -> None:
    from onnxtrain.onnxblock._context import BuildContext

    ctx = BuildContext(model)
    names = [output_names] if isinstance(output_names, str) else list(output_names)
    model.graph.outputs.clear()
    model.graph.outputs.extend(ctx.value(n) for n in names)


class ForwardBlock(Block):
    """A block whose ``build`` output becomes the graph output of a forward model.

    Example:
        >>> from onnxtrain import onnxblock
        >>> class WithLoss(onnxblock.ForwardBlock):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.loss = onnxblock.loss.MSELoss()
        ...     def build(self, output_name):
        ...         return self.loss(output_name)
    """

    def __init__(self):
        super().__init__()
        self._model: ir.Model | None = None

    @abstractmethod
    def build(self, *args, **kwargs):
        """Stack blocks on the model; return the name(s) of the output(s)."""

    def __call__(self, *args, **kwargs):
        output = super().__call__(*args, **kwargs)
        _register_outputs(self.context.ir_model, output)
        self._model = io.load_model(io.to_proto(self.context.ir_model))
        return output

    def to_model_proto(self):
        if self._model is None:
            raise RuntimeError("call the block on the model before asking for the forward model")
        return io.to_proto(self._model)


class TrainingBlock(Block):
    """A block whose ``build`` returns the loss; calling it builds the training and eval models.

    Parameters to train are named with ``requires_grad(name)``, parameters to keep fixed
    with ``requires_grad(name, False)``; initializers named in neither stay constants.

    Example:
        >>> import numpy as np
        >>> from onnx import helper, numpy_helper, TensorProto
        >>> from onnxtrain import onnxblock
        >>> w = numpy_helper.from_array(np.ones((2, 2), np.float32), "w")
        >>> g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], [w])
        >>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        >>> class Train(onnxblock.TrainingBlock):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.loss = onnxblock.loss.MSELoss()
        ...     def build(self, output_name):
        ...         return self.loss(output_name)
        >>> block = Train()
        >>> block.requires_grad("w")
        >>> with onnxblock.base(m):
        ...     _ = block("y")
        ...     training_model, eval_model = block.to_model_proto()
        >>> [o.name for o in training_model.graph.output][-1]
        'w_grad.accumulation.out'
    """

    def __init__(self):
        super().__init__()
        self._requires_grad: list[str] = []
        self._frozen: list[str] = []
        # as upstream, only what requires_grad() named trains; generate_artifacts(requires_grad=None)
        # sets this to train every float initializer instead (onnxtrain's default there)
        self._trains_every_parameter = False
        self._parameters: Parameters | None = None
        self._training_model: ir.Model | None = None
        self._eval_model: ir.Model | None = None
        self.additional_output_names: list[str] = []
        # mixed precision (passes/precision.py) and the initial loss scale of fp16 dynamic loss
        # scaling (onnxblock/loss_scale.py); generate_artifacts(precision=...) sets them
        self.precision = None
        self.loss_scale: float | None = None

    @abstractmethod
    def build(self, *args, **kwargs):
        """Stack blocks on the model; return the name of the loss (or a tuple: the loss's name
        then the names of other values the training and eval models output)."""

    def requires_grad(self, argument_name: str, value: bool = True) -> None:
        """Mark a parameter as trainable (``value=True``) or frozen (``value=False``)."""
        for lst in (self._requires_grad, self._frozen):
            if argument_name in lst:
                lst.remove(argument_name)
        (self._requires_grad if value else self._frozen).append(argument_name)

    def __call__(self, *args, **kwargs):
        ctx = active()
        user_inputs = [v.name for v in ctx.graph.inputs]
        # the base model's outputs (blocks add nodes, not outputs): the eval model keeps them all
        base_outputs = [v.name for v in ctx.graph.outputs]
        before = set(ctx.graph.initializers)
        built = super().__call__(*args, **kwargs)
        # initializers the blocks added are constants of the loss, unless a block made them parameters
        constants = set(ctx.graph.initializers) - before - set(ctx.new_parameters)
        named = None if self._trains_every_parameter else self._requires_grad
        self._parameters = select_parameters(ctx.ir_model, named, self._frozen,
                                             added=ctx.new_parameters, constants=constants)
        # the loss name, or (as upstream) the loss then more outputs for the training and eval models
        names = list(built) if isinstance(built, (tuple, list)) else [built]
        if not names or not all(isinstance(n, str) for n in names):
            raise ArtifactError(f"a TrainingBlock's build must return the loss name (or the loss name then "
                                f"other output names), got {built!r}")
        loss_name, extra = names[0], names[1:]
        # as upstream: the loss, the values the build returned after it, then additional_output_names
        additional = [*extra, *(n for n in self.additional_output_names if n not in extra)]
        model = io.load_model(io.to_proto(ctx.ir_model))
        self._training_model, self._eval_model = build_training_and_eval(
            model, loss_name, self._parameters, user_inputs, additional,
            precision=self.precision, loss_scale=self.loss_scale, inference_outputs=base_outputs,
        )
        # the loss output may have been renamed (a block's generated name becomes "loss")
        loss_output = self._training_model.graph.outputs[0].name
        return loss_output if isinstance(built, str) else (loss_output, *extra)

    def parameters(self):
        """``(trainable, frozen)`` lists of ``onnx.TensorProto``, as upstream returns them."""
        if self._parameters is None:
            raise RuntimeError("call the block on the model before asking for its parameters")
        from onnx import numpy_helper

        return ([numpy_helper.from_array(v, n) for n, v in self._parameters.trainable.items()],
                [numpy_helper.from_array(v, n) for n, v in self._parameters.frozen.items()])

    @property
    def parameter_values(self) -> Parameters:
        if self._parameters is None:
            raise RuntimeError("call the block on the model before asking for its parameters")
        return self._parameters

    def to_model_proto(self):
        """``(training_model, eval_model)`` as ``onnx.ModelProto``."""
        if self._training_model is None:
            raise RuntimeError("call the block on the model before asking for the training model")
        return io.to_proto(self._training_model), io.to_proto(self._eval_model)

    def to_ir_models(self) -> tuple[ir.Model, ir.Model]:
        if self._training_model is None:
            raise RuntimeError("call the block on the model before asking for the training model")
        return self._training_model, self._eval_model
