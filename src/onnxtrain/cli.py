"""The ``onnxtrain`` command line."""

from __future__ import annotations

import argparse
import sys

_LOSSES = {"mse": "MSELoss", "crossentropy": "CrossEntropyLoss", "bce": "BCEWithLogitsLoss", "l1": "L1Loss"}
_OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD"}


def _demo(args) -> int:
    from onnxtrain.demo import REQUIRED_ACCURACY, run_demo

    result = run_demo(args.out, epochs=args.epochs, seed=args.seed, progress=not args.no_progress)
    print(f"test accuracy (eval model): {result.test_accuracy:.4f}")
    print(f"test accuracy (exported inference model, plain InferenceSession): {result.inference_accuracy:.4f}")
    print(f"final training loss: {result.final_loss:.4f}   time: {result.seconds:.1f} s")
    print(f"artifacts in {result.artifact_directory}/, inference model {result.inference_model}")
    print(f"run log {result.run_log} (onnxtrain report {result.artifact_directory})"
          + (f", plot {result.plot}" if result.plot else ""))
    if result.test_accuracy < REQUIRED_ACCURACY or abs(result.inference_accuracy - result.test_accuracy) > 1e-9:
        print(f"FAILED: expected accuracy >= {REQUIRED_ACCURACY} and identical results from the exported model",
              file=sys.stderr)
        return 1
    print("demo passed")
    return 0


def _artifacts(args) -> int:
    from onnxtrain import artifacts

    if args.enable_type_reduction and not args.ort_format:
        print("onnxtrain: error: --enable-type-reduction applies to --ort-format only", file=sys.stderr)
        return 2

    loss = None if args.loss == "none" else artifacts.LossType[_LOSSES[args.loss]]
    optimizer = None if args.optimizer == "none" else artifacts.OptimType[_OPTIMIZERS[args.optimizer]]
    artifacts.generate_artifacts(
        args.model, requires_grad=args.requires_grad, frozen_params=args.frozen or None, loss=loss,
        optimizer=optimizer, artifact_directory=args.output, prefix=args.prefix,
        additional_output_names=args.additional_output or None, nominal_checkpoint=args.nominal,
        loss_input_names=args.loss_input or None,
    )
    print(f"artifacts written to {args.output}")
    if args.ort_format:
        _print_ort_format(artifacts.convert_to_ort_format(
            args.output, prefix=args.prefix, enable_type_reduction=args.enable_type_reduction))
    return 0


def _ort_format(args) -> int:
    from onnxtrain import artifacts

    _print_ort_format(artifacts.convert_to_ort_format(
        args.directory, prefix=args.prefix, enable_type_reduction=args.enable_type_reduction,
        optimization_level=args.optimization_level, target_platform=args.target_platform))
    return 0


def _print_ort_format(result) -> None:
    print(f"ORT format models written: {', '.join(str(path) for path in result.models)}")
    print(f"required operators for a minimal onnxruntime build: {result.config}")


def _report(args) -> int:
    from onnxtrain import runlog

    try:
        print(runlog.summarize(args.directory).text())
        if args.plot is not None:
            print(f"plot written to {runlog.plot(args.directory, args.plot or None)}")
    except runlog.RunLogError as exc:
        print(f"onnxtrain report: {exc}", file=sys.stderr)
        return 2
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxtrain", description="Train models with stock ONNX Runtime.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small CNN on scikit-learn's digits through the artifacts flow")
    demo.add_argument("--out", default="demo_out", help="folder for artifacts and the exported model")
    demo.add_argument("--epochs", type=_positive_int, default=20)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(run=_demo)

    report = sub.add_parser("report", help="summarize a training run's log (run.jsonl from onnxtrain.runlog)")
    report.add_argument("directory", help="the run's folder (or its run.jsonl)")
    report.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                        help="also draw loss and throughput (default path: DIRECTORY/training.png)")
    report.set_defaults(run=_report)

    art = sub.add_parser("artifacts", help="generate training artifacts from an ONNX model")
    art.add_argument("model", help="the ONNX model file")
    art.add_argument("--requires-grad", nargs="*", default=None,
                     help="initializers to train (default: every float initializer of rank >= 1 not frozen)")
    art.add_argument("--frozen", nargs="*", default=[], help="initializers to keep fixed")
    art.add_argument("--loss", choices=[*_LOSSES, "none"], default="crossentropy")
    art.add_argument("--optimizer", choices=[*_OPTIMIZERS, "none"], default="adamw")
    art.add_argument("-o", "--output", default="artifacts", help="output folder")
    art.add_argument("--prefix", default="")
    art.add_argument("--additional-output", nargs="*", default=[], help="values to output besides the loss")
    art.add_argument("--loss-input", nargs="*", default=[], help="model outputs fed to the loss")
    art.add_argument("--nominal", action="store_true", help="also write nominal_checkpoint (names, shapes, no values)")
    art.add_argument("--ort-format", action="store_true",
                     help="also write the models in ORT format (mobile, minimal builds) and required_operators.config"
                          " (the same as `onnxtrain ort-format OUTPUT` afterwards)")
    art.add_argument("--enable-type-reduction", action="store_true",
                     help="with --ort-format: list the operators' types too (required_operators_and_types.config)")
    art.set_defaults(run=_artifacts)

    from onnxtrain.artifacts import ORT_OPTIMIZATION_LEVELS, ORT_TARGET_PLATFORMS

    ort_format = sub.add_parser(
        "ort-format", help="convert a folder of artifacts to ORT format and write the required-operators config")
    ort_format.add_argument("directory", help="the artifacts' folder (training_model.onnx, eval_model.onnx, ...)")
    ort_format.add_argument("--prefix", default="", help="the prefix the artifacts were generated with")
    ort_format.add_argument("--enable-type-reduction", action="store_true",
                            help="list the operators' types too (required_operators_and_types.config)")
    ort_format.add_argument("--optimization-level", choices=ORT_OPTIMIZATION_LEVELS, default="all",
                            help="graph optimizations saved in the .ort files (default: all, as the runtime's)")
    ort_format.add_argument("--target-platform", choices=ORT_TARGET_PLATFORMS, default=None,
                            help="amd64 keeps x86-only layout optimizations (default: portable)")
    ort_format.set_defaults(run=_ort_format)
    return parser


def main(argv: list[str] | None = None) -> int:
    from onnxtrain.errors import OnnxTrainError

    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except OnnxTrainError as exc:  # a user error: the message says what to fix, no traceback
        print(f"onnxtrain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
