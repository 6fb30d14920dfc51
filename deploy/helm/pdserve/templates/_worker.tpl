{{/*
A prefill or decode Deployment plus its headless Service. Call with
(dict "ctx" $ "role" "prefill"|"decode").
*/}}
{{- define "pdserve.worker" -}}
{{- $ctx := .ctx }}
{{- $role := .role }}
{{- $cfg := index $ctx.Values $role }}
{{- $values := $ctx.Values }}
{{- $kv := $values.kvTransfer }}
{{- $model := $values.model }}
{{- $engine := $values.engine }}
{{- $lora := $values.lora }}
{{- $loraVolume := and $lora.enabled (ne $lora.source "none") }}
{{- $fullname := include "pdserve.fullname" $ctx }}
{{- $meta := dict "ctx" $ctx "cfg" $cfg "component" $role }}
{{- $device := $cfg.device | default (ternary "cuda" "cpu" (gt (int $cfg.gpus) 0)) }}
{{- $modelArg := $model.path }}
{{- if ne $model.source "image" }}
{{- $modelArg = trimSuffix "/" (printf "%s/%s" $model.mountPath (trimPrefix "/" $model.path)) }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $fullname }}-{{ $role }}
  labels:
    {{- include "pdserve.labels" $meta | nindent 4 }}
spec:
  {{- /* with the planner on, the replica count is the planner's after the install */}}
  {{- if and (not $cfg.autoscaling.enabled) (or (not $values.planner.enabled) $ctx.Release.IsInstall) }}
  replicas: {{ int $cfg.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $meta | nindent 6 }}
  # GPUs are scarce: replace pods one at a time instead of surging.
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 0
      maxUnavailable: 1
  template:
    metadata:
      {{- include "pdserve.podMetadata" $meta | nindent 6 }}
    spec:
      {{- include "pdserve.podSpec" (set (deepCopy $meta) "serviceAccount" (include "pdserve.workerServiceAccountName" (dict "ctx" $ctx "role" $role))) | nindent 6 }}
      {{- $enroll := $values.enrollment }}
      {{- if or $values.buildCache.prepare (and $lora.enabled (eq $lora.source "init")) $enroll.enabled }}
      initContainers:
      {{- end }}
      {{- if $enroll.enabled }}
        # First: this pod's own enrollment token (security.enroller), fetched with its projected
        # ServiceAccount token, which no other container mounts; the worker reads the file.
        - name: enroll
          image: {{ include "pdserve.image" $ctx | quote }}
          imagePullPolicy: {{ $values.image.pullPolicy }}
          command: ["pdserve"]
          args:
            - enroll
            - {{ printf "--enroller-url=%s" (include "pdserve.enrollerUrl" $ctx) | quote }}
            - {{ printf "--service-account-token-file=%s/token" (include "pdserve.enrollSaTokenDir" $ctx) | quote }}
            - {{ printf "--out=%s/token" (include "pdserve.enrollmentTokenDir" $ctx) | quote }}
            - {{ printf "--timeout-s=%v" $enroll.initTimeoutS | quote }}
            {{- if include "pdserve.internalTlsSecretName" $ctx }}
            - "--ca-file=/etc/pdserve/internal-tls/ca.crt"
            - "--server-name=pdserve-internal"
            {{- end }}
          env:
            {{- include "pdserve.baseEnv" $ctx | nindent 12 }}
          resources:
            requests: {cpu: 10m, memory: 64Mi}
            limits: {memory: 256Mi}
          securityContext:
            {{- toYaml $values.securityContext | nindent 12 }}
          volumeMounts:
            - name: enroll-sa-token
              mountPath: {{ include "pdserve.enrollSaTokenDir" $ctx }}
              readOnly: true
            - name: enrollment
              mountPath: {{ include "pdserve.enrollmentTokenDir" $ctx }}
            {{- include "pdserve.internalTlsMount" $ctx | nindent 12 }}
      {{- end }}
      {{- if and $lora.enabled (eq $lora.source "init") }}
        # Before the worker starts: the LoRA adapters written into their emptyDir.
        - name: lora-adapters
          image: {{ $lora.init.image | default (include "pdserve.image" $ctx) | quote }}
          imagePullPolicy: {{ $values.image.pullPolicy }}
          command:
            {{- toYaml $lora.init.command | nindent 12 }}
          env:
            - name: PDSERVE_LORA_DIR
              value: {{ $lora.mountPath | quote }}
          securityContext:
            {{- toYaml $values.securityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: lora-adapters
              mountPath: {{ $lora.mountPath }}
      {{- end }}
      {{- if $values.buildCache.prepare }}
        # Before the worker starts: the model converted and, on CPU, the attention kernel built
        # into the build cache (`pdserve prepare`). With buildCache.existingClaim that happens once
        # per volume, later pods find both; the model the image ships was prepared at build time.
        - name: prepare
          image: {{ include "pdserve.image" $ctx | quote }}
          imagePullPolicy: {{ $values.image.pullPolicy }}
          command: ["pdserve"]
          args:
            - prepare
            - {{ printf "--model=%s" $modelArg | quote }}
            - {{ printf "--device=%s" $device | quote }}
          env:
            {{- include "pdserve.baseEnv" $ctx | nindent 12 }}
            {{- include "pdserve.cacheEnv" (dict "ctx" $ctx "serving" false) | nindent 12 }}
            {{- with $cfg.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- include "pdserve.resources" $cfg | nindent 12 }}
          securityContext:
            {{- toYaml $values.securityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: cache
              mountPath: {{ $values.buildCache.mountPath }}
            {{- if ne $model.source "image" }}
            - name: model
              mountPath: {{ $model.mountPath }}
              readOnly: true
            {{- end }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "pdserve.image" $ctx | quote }}
          imagePullPolicy: {{ $values.image.pullPolicy }}
          command: ["pdserve"]
          args:
            - {{ $role }}
            - {{ printf "--host=%s" $values.listenHost | quote }}
            - {{ printf "--grpc-port=%d" (int $cfg.grpcPort) | quote }}
            - "--advertise-host=$(POD_IP)"
            - "--worker-id=$(POD_NAME)"
            - {{ printf "--router=%s" (include "pdserve.routerRegistrationAddress" $ctx) | quote }}
            - {{ include "pdserve.clusterSecretArg" $ctx }}
            {{- include "pdserve.internalTlsArgs" $ctx | nindent 12 }}
            - {{ printf "--log-level=%s" $values.logLevel | quote }}
            - {{ printf "--metrics-port=%d" (int $values.metrics.port) | quote }}
            - {{ include "pdserve.metricsTokenArg" $ctx }}
            {{- if $enroll.enabled }}
            - {{ printf "--enrollment-token-file=%s/token" (include "pdserve.enrollmentTokenDir" $ctx) | quote }}
            {{- end }}
            {{- include "pdserve.redisArgs" $ctx | nindent 12 }}
            - {{ printf "--model=%s" $modelArg | quote }}
            {{- with $model.servedModelName }}
            - {{ printf "--served-model-name=%s" . | quote }}
            {{- end }}
            - {{ printf "--device=%s" $device | quote }}
            {{- with $cfg.numThreads }}
            - {{ printf "--num-threads=%d" (int64 .) | quote }}
            {{- end }}
            {{- with $engine.dtype }}
            - {{ printf "--dtype=%s" . | quote }}
            {{- end }}
            {{- with $engine.quantization }}
            - {{ printf "--quantization=%s" . | quote }}
            {{- end }}
            {{- with $engine.blockSize }}
            - {{ printf "--block-size=%d" (int64 .) | quote }}
            {{- end }}
            {{- with $engine.maxModelLen }}
            - {{ printf "--max-model-len=%d" (int64 .) | quote }}
            {{- end }}
            {{- with $engine.maxKvTokens }}
            - {{ printf "--max-kv-tokens=%d" (int64 .) | quote }}
            {{- end }}
            {{- with $engine.freeMemoryFraction }}
            - {{ printf "--free-memory-fraction=%v" . | quote }}
            {{- end }}
            {{- with $engine.maxNumTokens }}
            - {{ printf "--max-num-tokens=%d" (int64 .) | quote }}
            {{- end }}
            {{- with $engine.maxBatchSize }}
            - {{ printf "--max-batch-size=%d" (int64 .) | quote }}
            {{- end }}
            {{- with $engine.attentionWindow }}
            - {{ printf "--attention-window=%d" (int64 .) | quote }}
            {{- end }}
            {{- with $engine.capacityPolicy }}
            - {{ printf "--capacity-policy=%s" . | quote }}
            {{- end }}
            {{- with $engine.chunkingPolicy }}
            - {{ printf "--chunking-policy=%s" . | quote }}
            {{- end }}
            {{- with $engine.speculativeConfig }}
            - {{ printf "--speculative-config=%s" (toJson .) | quote }}
            {{- end }}
            - {{ printf "--kv-backends=%s" (join "," $kv.backends) | quote }}
            - {{ printf "--transfer-port=%d" (int $kv.port) | quote }}
            {{- with $kv.timeoutS }}
            - {{ printf "--transfer-timeout-s=%v" . | quote }}
            {{- end }}
            {{- with $kv.probeCooldownS }}
            - {{ printf "--kv-probe-cooldown-s=%v" . | quote }}
            {{- end }}
            {{- if $kv.diskStore.enabled }}
            - {{ printf "--disk-store=%s" $kv.diskStore.mountPath | quote }}
            - {{ printf "--disk-store-max-gb=%v" $kv.diskStore.maxGB | quote }}
            {{- end }}
            {{- with $kv.prefixStore }}
            - {{ printf "--prefix-store=%s" . | quote }}
            {{- end }}
            {{- if eq $role "prefill" }}
            {{- with $cfg.maxQueue }}
            - {{ printf "--max-queue=%d" (int64 .) | quote }}
            {{- end }}
            {{- else }}
            {{- with $cfg.failurePolicy }}
            - {{ printf "--failure-policy=%s" . | quote }}
            {{- end }}
            {{- end }}
            {{- if $lora.enabled }}
            - "--enable-lora"
            - {{ printf "--max-loras=%d" (int $lora.maxLoras) | quote }}
            - {{ printf "--max-lora-rank=%d" (int $lora.maxLoraRank) | quote }}
            - {{ printf "--max-cpu-loras=%d" (int $lora.maxCpuLoras) | quote }}
            - {{ printf "--lora-allowed-root=%s" $lora.mountPath | quote }}
            {{- range $lora.modules }}
            {{- $module := dict "name" .name "path" (printf "%s/%s" (trimSuffix "/" $lora.mountPath) (trimPrefix "/" .path)) }}
            {{- with .baseModelName }}{{- $_ := set $module "base_model_name" . }}{{- end }}
            - {{ printf "--lora-modules=%s" (toJson $module) | quote }}
            {{- end }}
            {{- end }}
            {{- range $cfg.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "pdserve.baseEnv" $ctx | nindent 12 }}
            {{- include "pdserve.cacheEnv" (dict "ctx" $ctx "serving" true) | nindent 12 }}
            - name: UCX_TLS
              value: {{ $kv.ucx.tls | quote }}
            - name: UCX_TCP_PORT_RANGE
              value: {{ $kv.ucx.tcpPortRange | quote }}
            {{- range $name, $value := $kv.ucx.extraEnv }}
            - name: {{ $name }}
              value: {{ $value | quote }}
            {{- end }}
            {{- include "pdserve.redisEnv" $ctx | nindent 12 }}
            {{- with $cfg.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ int $cfg.grpcPort }}
              protocol: TCP
            - name: transfer
              containerPort: {{ int $kv.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ int $values.metrics.port }}
              protocol: TCP
          {{- $mutualTLS := not (empty (include "pdserve.internalTlsSecretName" $ctx)) }}
          {{- include "pdserve.probes" (dict "probes" $cfg.probes "port" $cfg.grpcPort "mutualTLS" $mutualTLS) | trim | nindent 10 }}
          resources:
            {{- include "pdserve.resources" $cfg | nindent 12 }}
          securityContext:
            {{- toYaml $values.securityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: cache
              mountPath: {{ $values.buildCache.mountPath }}
              readOnly: {{ $values.buildCache.prepare }}
            - name: shm
              mountPath: /dev/shm
            {{- include "pdserve.clusterSecretMount" $ctx | nindent 12 }}
            {{- include "pdserve.metricsTokenMount" $ctx | nindent 12 }}
            {{- include "pdserve.redisKeyMount" $ctx | nindent 12 }}
            {{- if $enroll.enabled }}
            - name: enrollment
              mountPath: {{ include "pdserve.enrollmentTokenDir" $ctx }}
              readOnly: true
            {{- end }}
            {{- if ne $model.source "image" }}
            - name: model
              mountPath: {{ $model.mountPath }}
              readOnly: true
            {{- end }}
            {{- if $kv.diskStore.enabled }}
            - name: kv-store
              mountPath: {{ $kv.diskStore.mountPath }}
            {{- end }}
            {{- if $loraVolume }}
            - name: lora-adapters
              mountPath: {{ $lora.mountPath }}
              readOnly: true
            {{- end }}
      volumes:
        {{- include "pdserve.clusterSecretVolume" $ctx | nindent 8 }}
        {{- include "pdserve.metricsTokenVolume" $ctx | nindent 8 }}
        {{- include "pdserve.redisKeyVolume" $ctx | nindent 8 }}
        - name: tmp
          emptyDir:
            sizeLimit: 2Gi
        - name: cache
          {{- if $values.buildCache.existingClaim }}
          persistentVolumeClaim:
            claimName: {{ $values.buildCache.existingClaim }}
          {{- else }}
          emptyDir:
            sizeLimit: {{ $values.buildCache.sizeLimit }}
          {{- end }}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $values.shm.sizeLimit }}
        {{- if $enroll.enabled }}
        - name: enroll-sa-token
          projected:
            sources:
              - serviceAccountToken:
                  audience: {{ $enroll.audience | quote }}
                  expirationSeconds: {{ int $enroll.tokenExpirationSeconds }}
                  path: token
        - name: enrollment
          emptyDir:
            medium: Memory
            sizeLimit: 1Mi
        {{- end }}
        {{- if eq $model.source "pvc" }}
        - name: model
          persistentVolumeClaim:
            claimName: {{ $model.pvc.claimName }}
            readOnly: true
        {{- else if eq $model.source "hostPath" }}
        - name: model
          hostPath:
            path: {{ $model.hostPath.path }}
            {{- with $model.hostPath.type }}
            type: {{ . }}
            {{- end }}
        {{- end }}
        {{- if $kv.diskStore.enabled }}
        - name: kv-store
          persistentVolumeClaim:
            claimName: {{ $kv.diskStore.existingClaim | default (printf "%s-kv-store" $fullname) }}
        {{- end }}
        {{- if $loraVolume }}
        - name: lora-adapters
          {{- if eq $lora.source "pvc" }}
          persistentVolumeClaim:
            claimName: {{ $lora.pvc.claimName }}
            readOnly: true
          {{- else if eq $lora.source "hostPath" }}
          hostPath:
            path: {{ $lora.hostPath.path }}
            {{- with $lora.hostPath.type }}
            type: {{ . }}
            {{- end }}
          {{- else }}
          emptyDir:
            sizeLimit: {{ $lora.init.sizeLimit }}
          {{- end }}
        {{- end }}
---
# One DNS name per worker pod; only ready pods are listed.
apiVersion: v1
kind: Service
metadata:
  name: {{ $fullname }}-{{ $role }}
  labels:
    {{- include "pdserve.labels" $meta | nindent 4 }}
    pdserve.io/scrape: "true"
spec:
  clusterIP: None
  selector:
    {{- include "pdserve.selectorLabels" $meta | nindent 4 }}
  ports:
    - name: grpc
      port: {{ int $cfg.grpcPort }}
      targetPort: grpc
      protocol: TCP
      appProtocol: kubernetes.io/h2c
    - name: transfer
      port: {{ int $kv.port }}
      targetPort: transfer
      protocol: TCP
    - name: metrics
      port: {{ int $values.metrics.port }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
{{- end }}
