/**
 * LinearLRScheduler: linear warmup to the initial learning rate, then linear decay to 0.
 * @module
 */

/**
 * Sets the optimizer's learning rate from its step count `t` (updates done so far), exactly
 * as `onnxtrain.api.LinearLRScheduler`: `initialLr * t / warmupStepCount` while
 * `t < warmupStepCount`, then `initialLr * (totalStepCount - t) / (totalStepCount - warmupStepCount)`,
 * reaching 0 at `t = totalStepCount` and staying there. The rate is set at construction and by
 * every {@link LinearLRScheduler#step}, which belongs after `optimizer.step()`.
 *
 * @example
 * const scheduler = new LinearLRScheduler(optimizer, 2, 6, 0.1); // lr 0, 0.05, 0.1, 0.075, ...
 * await optimizer.step();
 * scheduler.step();
 */
export class LinearLRScheduler {
  /**
   * @param {{stepCount: number, setLearningRate(lr: number): void}} optimizer
   * @param {number} warmupStepCount  number of warmup steps (0 for none)
   * @param {number} totalStepCount  step count at which the learning rate reaches 0
   * @param {number} initialLr  the peak learning rate
   */
  constructor(optimizer, warmupStepCount, totalStepCount, initialLr) {
    for (const [name, value] of [['warmupStepCount', warmupStepCount], ['totalStepCount', totalStepCount]]) {
      if (!Number.isInteger(value) || /** @type {number} */ (value) < 0) {
        throw new RangeError(`${name} must be an integer >= 0, got ${value}`);
      }
    }
    if (typeof initialLr !== 'number' || !Number.isFinite(initialLr)) {
      throw new TypeError(`initialLr must be a finite number, got ${initialLr}`);
    }
    if (initialLr < 0) throw new RangeError(`initialLr must be >= 0, got ${initialLr}`);
    this._optimizer = optimizer;
    this.warmupStepCount = warmupStepCount;
    this.totalStepCount = totalStepCount;
    this.initialLr = initialLr;
    this.step();
  }

  /**
   * The multiplier of `initialLr` after `step` optimizer updates.
   * @param {number} step
   */
  factor(step) {
    const warmup = this.warmupStepCount;
    const total = this.totalStepCount;
    if (step < warmup) return step / Math.max(1, warmup);
    return Math.max(0, (total - step) / Math.max(1, total - warmup));
  }

  /** Set the optimizer's learning rate for its next update (call after `optimizer.step()`). */
  step() {
    this._optimizer.setLearningRate(this.initialLr * this.factor(this._optimizer.stepCount));
  }
}
